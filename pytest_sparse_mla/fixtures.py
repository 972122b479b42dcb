"""Fixtures of pytest-sparse-mla (``pytest --fixtures -p sparse_mla`` lists them).

The hooks module registers this module as a plugin in sessions that use the plugin (see
``pytest_sparse_mla.options.activation``); downstream tests then use the fixtures by name, no import
needed. Every fixture is typed, so a downstream test can annotate its arguments with the same types
(``SparseMlaImplementation`` from ``pytest_sparse_mla.implementations.protocol``,
``SparseMlaTolerances`` from ``pytest_sparse_mla.tolerances``, ...). torch, syrupy and the page
split are imported inside fixture bodies, so loading the plugin stays light.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from pytest_sparse_mla import capabilities, options

if TYPE_CHECKING:
    import torch
    from syrupy.assertion import SnapshotAssertion

    from pytest_sparse_mla.attention.cases import AttentionInputs
    from pytest_sparse_mla.data import PackedKVCache
    from pytest_sparse_mla.envelope import Envelope
    from pytest_sparse_mla.implementations.protocol import SparseMlaImplementation
    from pytest_sparse_mla.page_split.buffers import BufferRegistry
    from pytest_sparse_mla.tolerances import SparseMlaTolerances


#: The fixtures this module defines (``tests/test_papercuts.py`` checks the list): asked for in a
#: session that does not use the plugin, pytest's "fixture not found" says how to load it
#: (:func:`hint_inactive_fixture`).
FIXTURE_NAMES = (
    "sparse_mla_options",
    "sparse_mla_capabilities",
    "sparse_mla_device",
    "sparse_mla_seed",
    "sparse_mla_generator",
    "packed_kv_cache_factory",
    "split_buffer_registry",
    "page_split_backend",
    "split_pages",
    "sparse_mla_impl",
    "sparse_mla_envelope",
    "sparse_mla_inputs",
    "sparse_mla_tolerances",
    "sparse_mla_search_shard",
    "sparse_mla_search",
    "tensor_snapshot",
)


def hint_inactive_fixture(exc: BaseException, report: pytest.TestReport) -> None:
    """A session that does not use the plugin, where a test or fixture asked for one of its fixtures
    (:data:`FIXTURE_NAMES`): pytest's "fixture 'NAME' not found" (``exc``, the failed phase's
    exception) gets a line on ``report`` saying how to load it. Any other exception: nothing."""
    name = getattr(exc, "argname", None)
    if not isinstance(exc, pytest.FixtureLookupError) or name not in FIXTURE_NAMES:
        return
    hint = (
        f"{name} is a fixture of pytest-sparse-mla, which is inactive in this session: add -p sparse_mla "
        "(or any --sparse-mla-* option or sparse_mla_* ini key)"
    )
    longrepr: Any = report.longrepr
    errorstring = getattr(longrepr, "errorstring", None)
    if isinstance(errorstring, str):  # pytest's FixtureLookupErrorRepr: the hint under its first line
        first, newline, rest = errorstring.partition("\n")
        longrepr.errorstring = f"{first}\n{hint}{newline}{rest}"
    else:
        report.sections.append(("sparse-mla", hint))


@pytest.fixture(scope="session")
def sparse_mla_options(pytestconfig: pytest.Config) -> options.SparseMlaOptions:
    """The parsed ``--sparse-mla-*`` options of this session (:class:`options.SparseMlaOptions`)."""
    return options.get_options(pytestconfig)


@pytest.fixture(scope="session")
def sparse_mla_capabilities() -> capabilities.Capabilities:
    """What this machine offers: torch/CUDA/triton/flashinfer versions, GPU name and compute
    capability (:class:`capabilities.Capabilities`; probed once per process, cached)."""
    return capabilities.probe()


@pytest.fixture(scope="session")
def sparse_mla_device(
    sparse_mla_options: options.SparseMlaOptions,
    sparse_mla_capabilities: capabilities.Capabilities,
) -> torch.device:
    """The ``torch.device`` the suites run on, from ``--sparse-mla-device``.

    ``auto`` is ``cuda`` when torch sees a CUDA device, else ``cpu``. ``cuda`` on a machine whose
    torch sees no CUDA device is a usage error when the session starts (a device lost later skips
    the test; fails under ``--sparse-mla-require-gpu``). Under pytest-xdist each worker sees
    only the GPU it was pinned to, so ``cuda`` means that GPU.
    """
    import torch

    wanted = sparse_mla_options.device
    if wanted == "cpu" or (wanted == "auto" and not sparse_mla_capabilities.cuda_available):
        if sparse_mla_options.require_gpu:
            pytest.fail(
                f"--sparse-mla-require-gpu: the suites would run on the CPU "
                f"(--sparse-mla-device={wanted}, CUDA available: "
                f"{sparse_mla_capabilities.cuda_available})",
                pytrace=False,
            )
        return torch.device("cpu")
    if not sparse_mla_capabilities.cuda_available:
        message = f"--sparse-mla-device=cuda: no CUDA device ({sparse_mla_capabilities.summary()})"
        if sparse_mla_options.require_gpu:
            pytest.fail(f"--sparse-mla-require-gpu: {message}", pytrace=False)
        pytest.skip(message)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def sparse_mla_seed(request: pytest.FixtureRequest, sparse_mla_options: options.SparseMlaOptions) -> int:
    """A per-test seed (int in ``[0, 2**31)``): ``--sparse-mla-seed`` mixed by CRC-32 with the
    test's *path-independent* id, ``<file name>::<test name>[<params>]`` (the node id without its
    directories), so every test draws different data, reproducibly, on any xdist worker, and the
    same data whether the suites run from a checkout or from an installed package in any folder."""
    node = zlib.crc32(seed_id(request.node).encode())
    return (sparse_mla_options.seed * 1_000_003 + node) % (2**31)


def seed_id(node: pytest.Item) -> str:
    """``<file name>::<rest of the node id>``: the node id without the directories of its path
    (``suites/test_x.py::t[a]`` and ``/venv/.../pytest_sparse_mla/suites/test_x.py::t[a]`` give
    ``test_x.py::t[a]``)."""
    path, sep, rest = node.nodeid.partition("::")
    return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}{sep}{rest}"


@pytest.fixture
def sparse_mla_generator(sparse_mla_seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`sparse_mla_seed`.

    Draw on the CPU and move to the device: the same seed then gives bit-identical inputs on CPU
    and CUDA (see ``pytest_sparse_mla.data``).
    """
    import torch

    return torch.Generator(device="cpu").manual_seed(sparse_mla_seed)


@pytest.fixture
def packed_kv_cache_factory(
    sparse_mla_seed: int, sparse_mla_device: torch.device
) -> Callable[..., PackedKVCache]:
    """Factory for packed FP8 KV caches with their BF16 source and dequantized values.

    Call it as ``packed_kv_cache_factory(fmt="dsv4", num_pages=4, page_block_size=64,
    page_stride="padded", form="nhd", distribution="flashinfer", scale_rule=None,
    seed=None, device=None)``:

    * ``fmt``: ``"dsv4"`` (584 B/token, footer scales), ``"dsv3_2"`` (656 B/token, inline), or a
      DeepSeek-V4.1 record: ``"dsv4_1_swa"`` (528 B/token: 512 E4M3 + 16 UE8M0) or
      ``"dsv4_1_indexed"`` (288 B/token: 512 E2M1 + 32 E4M3);
    * ``scale_rule``: ``None`` (the format's writer rule), ``"flashmla"``, ``"sglang"`` or
      ``"dsv4_1"`` (``formats.scale_exponents``);
    * ``page_block_size``: tokens per page (DeepSeek-V4 pools: 256 SWA, 64 C4, 2 C128);
    * ``page_stride``: ``"tight"`` (``ps*B``), ``"padded"`` (FlashMLA/SGLang: 37,440 B at ps=64)
      or a byte count (a multiple of 16, ``>= ps*B``);
    * ``form``: ``"2d"`` ``[P, ps*B]``, ``"3d"`` ``[P, ps, B]``, ``"hnd"`` ``[P, 1, ps, B]``,
      ``"nhd"`` ``[P, ps, 1, B]``;
    * ``distribution``: ``"flashinfer"``, ``"uniform"`` or ``"wide"`` (``pytest_sparse_mla.data``);
    * ``seed``: overrides the per-test seed; each call without one draws fresh data;
    * ``device``: overrides :func:`sparse_mla_device`.

    Returns a :class:`pytest_sparse_mla.data.PackedKVCache` (``packed`` uint8 tensor, ``source``
    BF16 ``[P, ps, d_qk]``, ``dequantized`` fp32 ``[P, ps, d_qk]``, ``layout``).

    Raises ``TypeError`` / ``ValueError`` for bad arguments (see ``formats.quantize_pack``).
    """
    import torch

    from pytest_sparse_mla import data

    calls = 0

    def make(*, seed: int | None = None, device: Any = None, **kwargs: Any) -> PackedKVCache:
        nonlocal calls
        calls += 1
        generator = torch.Generator().manual_seed(
            seed if seed is not None else (sparse_mla_seed + 7919 * calls) % (2**31)
        )
        return data.make_packed_cache(
            generator, device=sparse_mla_device if device is None else device, **kwargs
        )

    return make


# --- page split (pytest_sparse_mla.page_split) ----------------------------------------------------


@pytest.fixture
def split_buffer_registry() -> Iterator[BufferRegistry]:
    """A fresh, empty :class:`pytest_sparse_mla.page_split.BufferRegistry` for this test only.

    Pass it as ``page_split(..., registry=split_buffer_registry)``: the persistent split and mask
    buffers (keys ``flash_mla_sm120_split{key_suffix}:{device}`` /
    ``flash_mla_sm120_mask{key_suffix}:{device}``, grow-only, zero-filled, allocated outside
    inference mode) then never leak between tests or xdist workers, and a test can inspect or
    poison them with ``lookup`` / ``install``. Buffers are dropped when the test ends.
    Convention source: sgl-project/sglang ``python/sglang/kernels/ops/attention/flash_mla_sm120.py``
    (``flash_mla_sm120_split:{dev}`` registry keys); key_suffix isolation: see
    ``pytest_sparse_mla.page_split.buffers``.
    """
    from pytest_sparse_mla.page_split import BufferRegistry

    registry = BufferRegistry()
    yield registry
    registry.clear()


@pytest.fixture(params=("torch", "triton"))
def page_split_backend(request: pytest.FixtureRequest, sparse_mla_device: torch.device) -> str:
    """Parametrises a test over the page-split backends: ``"torch"`` (reference) and ``"triton"``.

    ``"triton"`` is skipped when triton is not installed, or when the device is the CPU but the
    Triton kernels were already decorated as compiled (``TRITON_INTERPRET`` unset while CUDA is
    visible); on a CPU-only machine they run interpreted (``TRITON_INTERPRET=1``).
    """
    backend: str = request.param
    if backend == "triton":
        from pytest_sparse_mla.page_split import triton_unavailable_reason

        reason = triton_unavailable_reason(sparse_mla_device)
        if reason is not None:
            pytest.skip(f"backend 'triton': {reason}")
    return backend


@pytest.fixture
def split_pages(split_buffer_registry: Any, page_split_backend: str) -> Callable[..., torch.Tensor]:
    """``page_split`` bound to this test's registry and backend: ``split_pages(kv_cache, **kw)``.

    Keyword arguments are those of :func:`pytest_sparse_mla.page_split.page_split`
    (``src_page_block_size``, ``touched_indices``, ``key_suffix``, ``dst_page_stride``); the
    result is the ``[P*ratio, 64, 1, 584]`` uint8 view (or the input itself for 64-token pages).
    """
    from functools import partial

    from pytest_sparse_mla.page_split import page_split

    return partial(page_split, registry=split_buffer_registry, backend=page_split_backend)


# --- implementation under test and tolerances (pytest_sparse_mla.implementations) --------------


@pytest.fixture
def sparse_mla_impl(
    request: pytest.FixtureRequest, sparse_mla_device: torch.device, sparse_mla_envelope: Envelope
) -> SparseMlaImplementation:
    """The implementation under test, selected by ``--sparse-mla-impl`` (default ``reference``),
    behind the envelope guard (:class:`pytest_sparse_mla.guard.GuardedImplementation`: its forward
    is called only inside the implementation's envelope and returns one result shape; the object
    itself is ``.unguarded``). On CUDA, under a time limit, a forward call of a shape this process
    has not met is first run once on copies outside the limit (a JIT kernel's compile and autotune
    are not the kernel's run time; ``GuardedImplementation``'s ``untimed``).

    An object following the protocol of :mod:`pytest_sparse_mla.implementations.protocol`
    (``pack``, ``page_split``, ``sparse_mla_forward``, each optional; ``name``;
    ``tolerance_profile``), typed as :class:`~pytest_sparse_mla.implementations.protocol.SparseMlaImplementation`:
    the capabilities the test names in ``sparse_mla_needs(...)`` are there. The test is
    skipped, with the reason, when the implementation lacks a capability named by the test's
    ``sparse_mla_needs(...)`` markers or says it cannot run it on :func:`sparse_mla_device`
    (e.g. the ``flashinfer`` adapter without an SM12x GPU).

    Raises ``pytest.UsageError`` for an unknown or unimportable implementation (listing the valid
    names).
    """
    from pytest_sparse_mla import guard, implementations

    impl = implementations.get_implementation(request.config)
    reason = implementations.skip_reason_for(
        impl, implementations.needs_of(request.node), sparse_mla_device.type
    )
    if reason is not None:
        pytest.skip(reason)
    from pytest_sparse_mla import device_health

    declared = implementations.declared_envelope(impl) is not None
    node = request.node
    typed: SparseMlaImplementation = guard.GuardedImplementation(
        impl, sparse_mla_envelope, declared,
        untimed=lambda: device_health.untimed(node) if device_health.is_timed(node) else None,
    )  # fmt: skip
    return typed


@pytest.fixture
def sparse_mla_envelope(request: pytest.FixtureRequest) -> Envelope:
    """The :class:`pytest_sparse_mla.Envelope` the implementation under test is held to: its
    ``envelope`` attribute, else every call (``envelope.UNIVERSAL``, with every bitwise
    invariance claim when its tolerance profile is bitwise, as the bundled reference's).

    Raises ``pytest.UsageError`` when ``envelope`` is not an ``Envelope``.
    """
    from pytest_sparse_mla import guard, implementations

    impl = implementations.get_implementation(request.config)
    with options.usage_errors():  # an unknown compute_mode (tolerances.profile_for)
        env = guard.envelope_of(impl)
    return env


@pytest.fixture
def sparse_mla_inputs(
    request: pytest.FixtureRequest,
    sparse_mla_envelope: Envelope,
    sparse_mla_generator: torch.Generator,
    sparse_mla_device: torch.device,
) -> Callable[..., AttentionInputs]:
    """Factory: ``sparse_mla_inputs(case)`` -> the :class:`~pytest_sparse_mla.attention.cases.
    AttentionInputs` of ``case`` fitted to the implementation's envelope, drawn from
    :func:`sparse_mla_generator` on :func:`sparse_mla_device`.

    ``attention.cases.fit_case`` moves head counts, token counts, index widths (padded with ``-1``)
    and page sizes inside the envelope and drops what it does not take; the case keeps its name
    and lists the changes in ``fitted``. The inputs' ``lse_convention`` is ``"flashinfer"`` when
    the envelope honours it, else ``"flashmla"``, else ``None`` (no LSE). The classes the fitted
    case exercises are recorded for the coverage table (``pytest_sparse_mla.coverage``).

    Skips the test when the case is not applicable to the envelope (the reason names the field)
    and when a ``large`` case would run on the CPU. Raises as ``attention.cases.make_inputs``.
    """
    from dataclasses import replace

    from pytest_sparse_mla import coverage
    from pytest_sparse_mla.attention.cases import case_classes, fit_case
    from pytest_sparse_mla.envelope import NotApplicable
    from pytest_sparse_mla.parametrize import inputs_on

    env = sparse_mla_envelope

    def make(case: Any) -> AttentionInputs:
        try:
            fitted = fit_case(case, env)
        except NotApplicable as exc:
            pytest.skip(f"{case.name}: {exc}")
        marked = tuple(str(n) for mark in request.node.iter_markers(coverage.MARKER) for n in mark.args)
        request.node.user_properties.append((coverage.RAN, marked + case_classes(fitted)))
        if fitted.fitted:
            request.node.user_properties.append((coverage.FITTED, fitted.fitted))
        inputs = inputs_on(fitted, sparse_mla_generator, sparse_mla_device)
        return replace(inputs, lse_convention=env.lse_convention)

    return make


@pytest.fixture
def sparse_mla_tolerances(request: pytest.FixtureRequest, sparse_mla_envelope: Envelope) -> SparseMlaTolerances:
    """The comparison model in force for this test: a
    :class:`pytest_sparse_mla.tolerances.SparseMlaTolerances`.

    ``tol.check_result(result, oracle)`` compares a forward result with an ``OracleOutput``
    (scale-aware: elementwise bound scaled by ``sum_j w_j |V_j|``, per-row and overall normwise
    relative error, cosine, LSE in absolute natural-log units); ``tol.check_invariant(a, b)``
    compares two results of one implementation. The profile follows the implementation's
    ``compute_mode`` (``"exact"`` -> ``tight``, ``"bf16"`` -> ``kernel``, ``"fp8"`` ->
    ``kernel-fp8``) or its ``tolerance_profile``, overridden per suite by a
    ``sparse_mla_tolerance(profile=..., PARAMETER=VALUE)`` marker and per profile by the
    ``sparse_mla_tolerances`` ini option (``PROFILE.PARAMETER = VALUE`` lines). The derivation of
    every bound is in ``pytest_sparse_mla.tolerances``. The invariances compared bit for bit by
    name (``claim=``) are those of :func:`sparse_mla_envelope`.
    """
    from dataclasses import replace

    from pytest_sparse_mla import implementations, tolerances

    impl = implementations.get_implementation(request.config)
    with options.usage_errors():  # an unknown compute_mode; a bad marker parameter
        resolved = tolerances.resolve(
            tolerances.profile_for(impl),
            options.get_options(request.config).tolerances,
            list(request.node.iter_markers(tolerances.MARKER)),
        )
    return replace(resolved, bitwise_claims=frozenset(sparse_mla_envelope.bitwise_invariance))


# --- the search (pytest_sparse_mla.search) ---------------------------------------------------------


@pytest.fixture
def sparse_mla_search_shard(request: pytest.FixtureRequest) -> int:
    """This search test's global shard index (``--sparse-mla-search-shards``; 0 when not sharded;
    with ``--sparse-mla-search-shard-group I/N``, from ``I*K`` on: ``pytest_sparse_mla.shards``)."""
    return int(getattr(request, "param", 0))


@pytest.fixture
def sparse_mla_search(
    request: pytest.FixtureRequest, sparse_mla_options: options.SparseMlaOptions, sparse_mla_search_shard: int
) -> Any:
    """The search run of a search test: a :class:`pytest_sparse_mla.search_run.SearchRun`.

    Use it inside the test: write the property as a function of one drawn call that builds it
    (``search.build``), records it (``sparse_mla_search.note(call, inputs)``) and raises on a
    discrepancy, then ``sparse_mla_search.check(prop, envelope, device)``: the covering calls of
    this shard (every end of every dimension the envelope admits), then random draws in rounds up
    to ``--sparse-mla-search-examples`` calls in all, the covering calls counted (default 8; 0
    skips the test), each distinct discrepancy shrunk and reported with its region
    (``pytest_sparse_mla.search_run``).
    ``--sparse-mla-search-seed`` (default: derandomized, no example database); global shard ``k``
    (``--sparse-mla-search-shards``, ``--sparse-mla-search-shard-group``) draws from ``seed + k``
    (derandomized: a distinct seed per shard, ``shards.hypothesis_seed``) and takes every ``k``-th
    covering call of all the matrix's shards.
    On CUDA the kernel is warmed on each new shape outside the test's time limit, up to a warm-up
    budget of the test's own limit (``search_run``, "Compiling is not judged time"). Past
    ``search_run.TIME_SHARE`` of that limit the run stops refining (region searches, shrinking) and
    still makes its draws (``search_run``, "A run ends inside its time limit").
    The known regions are the ``# [KEY] region: ...`` lines of ``--sparse-mla-xfail-file``
    (``pytest_sparse_mla.regions``). What the run drew goes to the test's ``user_properties``
    (terminal summary "sparse-mla search", ``--sparse-mla-report-json`` ``"search"``). A test
    expected to fail (an ``xfail`` mark whose condition holds; not under ``--runxfail``) whose
    xfail file names no region stops at its first failing call, unshrunk.

    A ``@given`` function can still be run as one round with ``sparse_mla_search.run(test)``.

    Skips the test when hypothesis is not installed or the budget is 0.
    """
    pytest.importorskip("hypothesis")
    from pytest_sparse_mla import device_health, regions, search_run

    if sparse_mla_options.search_examples == 0:
        pytest.skip("--sparse-mla-search-examples=0: the search is off")

    def keep(key: str, value: Any) -> None:
        request.node.user_properties.append((key, value))

    known = regions.read_regions(sparse_mla_options.xfail_file) if sparse_mla_options.xfail_file else []
    limit = request.node.get_closest_marker("timeout")
    seconds = float(limit.args[0]) if limit is not None and limit.args and limit.args[0] else None
    run = search_run.SearchRun(
        sparse_mla_options.search_examples, sparse_mla_options.search_seed, sparse_mla_search_shard, keep,
        shrink=not _expected_to_fail(request), known=known, confirm=_expected_to_fail(request),
        shards=sparse_mla_options.search_shards * (g.count if (g := sparse_mla_options.search_shard_group) else 1),
        untimed=lambda: device_health.untimed(request.node),
        warm_seconds=seconds,
        judged_seconds=seconds * search_run.TIME_SHARE if seconds is not None else None,
    )  # fmt: skip
    run.last_kernel_call = device_health.last_call  # a failure before the kernel is called is the search's
    return run


def _expected_to_fail(request: pytest.FixtureRequest) -> bool:
    """Whether the test carries an ``xfail`` mark whose condition holds (no condition, or a true
    one; a string condition is left to pytest and counted as holding) and ``--runxfail`` is off."""
    if request.config.getoption("runxfail", False):
        return False
    return any(all(bool(c) for c in mark.args) for mark in request.node.iter_markers("xfail"))


# --- golden snapshots (pytest_sparse_mla.snapshot) --------------------------------------------


@pytest.fixture
def tensor_snapshot(request: pytest.FixtureRequest) -> SnapshotAssertion:
    """syrupy's ``snapshot`` using :class:`pytest_sparse_mla.snapshots.TensorSnapshotExtension`.

    Compare a tensor with its golden file, naming each snapshot of a test::

        from pytest_sparse_mla.snapshots import close, exact

        assert tensor_snapshot(name="packed") == exact(cache.packed)
        assert tensor_snapshot(name="output") == close(res.output, atol=2e-3, rtol=1e-2)

    ``exact`` compares shape, dtype, strides and the SHA-256 of the raw bytes; ``close`` compares
    shape, dtype and values within ``atol + rtol * |golden|``. Files:
    ``<golden root>/<suite>/<module>/<test>[<name>].tensor.json``; the root is
    ``--sparse-mla-golden-dir`` / ini ``sparse_mla_golden_dir`` or
    ``snapshots.default_golden_dir()``. Write or refresh goldens with ``--snapshot-update`` (one
    process only).

    Skips the test when syrupy is not installed (the reason names the version this package pins)
    or its plugin is disabled (``-p no:syrupy``).
    """
    from pytest_sparse_mla.snapshot import session as snapshot_session

    try:
        from pytest_sparse_mla.snapshot.extension import TensorSnapshotExtension
    except ImportError as exc:
        pytest.skip(snapshot_session.syrupy_missing_reason(exc))
    if not request.config.pluginmanager.hasplugin("syrupy"):
        pytest.skip("golden snapshots need the syrupy pytest plugin (disabled with -p no:syrupy?)")
    snapshot: SnapshotAssertion = request.getfixturevalue("snapshot")
    return snapshot.use_extension(TensorSnapshotExtension)
