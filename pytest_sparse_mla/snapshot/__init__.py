"""Golden snapshots of tensors, in one package: one readable JSON file per snapshot, checked and
written through syrupy.

==========================  ====================================================================
module                      owns (imports)
==========================  ====================================================================
``file_format``             what a test asserts (``exact``, ``close``), the ``*.tensor.json``
                            format, ``read_tensor_snapshot``, ``compare_close`` (no pytest;
                            torch in functions)
``location``                the golden root's default and where each snapshot's file lives
                            (no pytest, no torch)
``session``                 a session's golden root, the ``--snapshot-update`` guard, the header
                            line, the syrupy-missing skip reason (pytest)
``extension``               ``TensorSnapshotExtension``, the syrupy extension (syrupy)
==========================  ====================================================================

Each module imports only those above it in the table. Tests use the ``tensor_snapshot`` fixture
(``pytest_sparse_mla.fixtures``) with ``exact`` / ``close``, imported from the stable public module
``pytest_sparse_mla.snapshots`` (which re-exports this package's public names)::

    from pytest_sparse_mla.snapshots import close, exact

    assert tensor_snapshot(name="packed") == exact(cache.packed)
    assert tensor_snapshot(name="output") == close(res.output, atol=2e-3, rtol=1e-2)

This package's ``__init__`` imports nothing.
"""
