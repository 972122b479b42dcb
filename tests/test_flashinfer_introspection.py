"""Self-test: an installed FlashInfer agrees with the bundled dispatch grids.

This checks the bundled tables (``pytest_sparse_mla.dispatch``), not a selected implementation;
an implementation that declares ``flashinfer_release`` is judged by ``suites/test_dispatch_grid.py``.

* ``test_installed_flashinfer_matches_bundled_grid``: CPU only, needs flashinfer-python (skipped
  with the reason otherwise). Reads the release's own tables (0.6.x frozensets, 0.7.x envelopes,
  ``supported_sparse_mla_sm120_configs()``, the 0.7.0 planner predicates), its C++ sources and
  message builders, and runs its 0.6.x Python routing with stubbed kernels
  (``scripts/flashinfer_introspect.py``, a CI tool of the checkout). A mismatch fails naming every
  differing cell.
* ``test_comparator_*``: CPU self-tests of the comparison itself on hand-made fake modules (no
  FlashInfer needed), so a drift is proven to be reported cell by cell.
* ``test_sm120_kernel_probe``: on SM120/SM121 hardware only, calls the real kernel on tiny
  inputs for each named cell and checks the verdict: runs, or raises the exact type and text.

Verified (CPU) against flashinfer-python 0.6.14, 0.6.17, 0.6.18, 0.7.0, 0.7.1, 0.7.2.post1 and
0.7.4 with apache-tvm-ffi 0.1.15.post2 and CPU torch 2.13.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from scripts_loader import load_script

from pytest_sparse_mla import deployments
from pytest_sparse_mla.dispatch import SparseMlaConfig, release_family, report, supports

introspect = load_script("flashinfer_introspect")

HEADS = (8, 16, 32, 64, 128)


@pytest.fixture(scope="module")
def installed_flashinfer() -> introspect.InstalledFlashInfer:
    """The installed FlashInfer's SM120 sparse-MLA modules (skips when they cannot be read)."""
    try:
        return introspect.load_installed()
    except introspect.IntrospectionUnavailable as exc:
        pytest.skip(f"cannot introspect FlashInfer here: {exc}")


@pytest.mark.sparse_mla_requires_flashinfer(">=0.6.14")
@pytest.mark.parametrize("check", introspect.CHECKS)
def test_installed_flashinfer_matches_bundled_grid(
    check: str, installed_flashinfer: introspect.InstalledFlashInfer, record_property  # type: ignore[no-untyped-def]
) -> None:
    result = introspect.run_check(check, installed_flashinfer)
    record_property("flashinfer_version", installed_flashinfer.version)
    record_property("introspection", result.summary())
    if result.status == "skipped":
        pytest.skip(f"flashinfer-python {installed_flashinfer.version}: {result.detail}")
    assert result.compared > 0
    assert result.status == "ok", (
        f"flashinfer-python {installed_flashinfer.version} differs from the bundled "
        f"{installed_flashinfer.family.label} grid:\n{result.summary()}"
    )


# ----------------------------------------------------------------------------------------------
# Self-tests of the comparators on fake modules (no FlashInfer needed).


def fake_0_6_17(extra_pairs: frozenset = frozenset(), page: int = 64) -> SimpleNamespace:
    """The 0.6.14-0.6.17 constants, typed from ``flashinfer/mla/_sparse_mla_sm120.py`` (15 + 20 pairs,
    page 64)."""
    return SimpleNamespace(
        _DECODE_DSV4_DISPATCH=frozenset((h, k) for h in HEADS for k in (128, 512, 1024))
        | extra_pairs,
        _DECODE_DSV3_2_DISPATCH=frozenset((h, k) for h in HEADS for k in (128, 512, 1024, 2048)),
        _DECODE_DSV4_PAGE_BLOCK_SIZE=page,
        _DECODE_DSV3_2_PAGE_BLOCK_SIZE=64,
        _DECODE_MAX_TOKENS=64,
    )


def test_comparator_accepts_the_published_0_6_17_tables() -> None:
    result = introspect.compare_decode_grid(release_family("0.6.17"), fake_0_6_17(), None)
    assert (result.status, result.compared) == ("ok", 15 + 20 + 3)


def test_comparator_names_each_differing_cell() -> None:
    fake = fake_0_6_17(extra_pairs=frozenset({(8, 192), (64, 2048)}), page=32)
    result = introspect.compare_decode_grid(release_family("0.6.17"), fake, None)
    assert result.status == "mismatch"
    assert sorted(map(str, result.mismatches)) == [
        "_DECODE_DSV4_PAGE_BLOCK_SIZE: bundled 64, installed 32",
        "decode DSV4 (num_heads=64, topk=2048): bundled absent, installed present",
        "decode DSV4 (num_heads=8, topk=192): bundled absent, installed present",
    ]
    assert "decode DSV4 (num_heads=8, topk=192)" in result.summary()


class FakeEnvelope:
    """A 0.7.1+-style decode envelope: membership 1 <= h <= max_heads and k >= 1, iteration
    over the dedicated heads paired with topk 1 (0.7.1's ``_DECODE_DSV4_DISPATCH``, printed on CPU)."""

    def __init__(self, max_heads: int = 128) -> None:
        self.max_heads = max_heads

    def __contains__(self, pair: object) -> bool:
        h, k = pair  # type: ignore[misc]
        return 1 <= h <= self.max_heads and k >= 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([(h, 1) for h in HEADS])


class FakeConfig:
    """``SparseMLASm120DecodeConfig`` of 0.7.1+: runtime page, topk >= 1, heads 1..max."""

    def __init__(self, topks: set[int], max_heads: int = 128) -> None:
        self.max_num_tokens, self.min_topk, self.max_num_heads = 64, 1, max_heads
        self.topks, self.page_block_size_is_runtime = frozenset(topks), True

    def supports_decode(self, h: int, k: int, *, num_tokens: int, page_block_size: int) -> bool:
        return num_tokens <= 64 and 1 <= h <= self.max_num_heads and k >= 1


def fake_0_7_4(max_heads: int = 128) -> tuple[SimpleNamespace, SimpleNamespace]:
    def static(heads: int) -> SimpleNamespace:  # _policy._StaticFamilyEnvelope fields
        return SimpleNamespace(dedicated_heads=frozenset(HEADS), max_num_heads=heads, min_topk=1,
                               page_block_size_is_runtime=True)  # fmt: skip

    sm = SimpleNamespace(
        _DECODE_DSV4_DISPATCH=FakeEnvelope(max_heads),
        _DECODE_DSV3_2_DISPATCH=FakeEnvelope(),
        _policy=SimpleNamespace(_STATIC_DECODE_ENVELOPE={0: static(128), 1: static(max_heads)}),
    )
    configs = {
        "dsv4": FakeConfig({128, 192, 256, 512, 1024}, max_heads),
        "dsv3_2": FakeConfig({128, 512, 1024, 2048}),
    }
    return sm, SimpleNamespace(supported_sparse_mla_sm120_configs=lambda: configs)


def test_comparator_on_a_0_7_envelope() -> None:
    fam = release_family("0.7.4")
    assert introspect.compare_decode_grid(fam, *fake_0_7_4()).status == "ok"
    drifted = introspect.compare_decode_grid(fam, *fake_0_7_4(max_heads=64))
    cells = {m.cell for m in drifted.mismatches}
    assert "(100, 128) in _DECODE_DSV4_DISPATCH" in cells
    assert "supported_sparse_mla_sm120_configs()['dsv4'].max_num_heads" in cells
    assert "dsv4.supports_decode(num_heads=128, topk=1, num_tokens=1, page_block_size=32)" in cells
    assert "_policy._STATIC_DECODE_ENVELOPE[1].max_num_heads" in cells


def test_comparator_on_error_texts() -> None:
    """A release whose message builder differs by one word is reported per config."""
    fam = release_family("0.7.4")

    def builder(**kw: int) -> str:
        return (
            f"SM120 sparse-MLA has no decode kernel for this shape: num_tokens={kw['num_tokens']}"
        )

    result = introspect.compare_error_texts(fam, SimpleNamespace(_decode_dispatch_error_message=builder))
    assert result.status == "mismatch" and result.compared == len(result.mismatches) > 0
    assert any(m.cell == "ValueError text for DSV4 T=65 H=24 topk=128 page=32" for m in result.mismatches)


def test_prefill_grid_is_skipped_with_a_reason_from_0_7_1() -> None:
    result = introspect.compare_prefill_grid(release_family("0.7.2.post1"))
    assert result.status == "skipped" and "compiled module" in result.detail


def test_load_installed_without_flashinfer_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(introspect, "installed_version", lambda: None)
    with pytest.raises(introspect.IntrospectionUnavailable, match="not installed"):
        introspect.load_installed()
    monkeypatch.setattr(introspect, "installed_version", lambda: "0.6.13")
    with pytest.raises(introspect.IntrospectionUnavailable, match="first release with it is 0.6.14"):
        introspect.load_installed()


# ----------------------------------------------------------------------------------------------
# SM120 hardware probe (cannot run on CPU machines; skipped there with the reason).


def _probe_cells() -> list[SparseMlaConfig]:
    cells = {report.deployment_config(d, phase) for d in deployments.DEPLOYMENTS for phase in deployments.PHASES}
    cells |= {
        SparseMlaConfig("DSV4", 65, 32, 256, 64),  # flashinfer-ai/flashinfer #3828
        SparseMlaConfig("DSV4", 65, 64, 128, 64, 512, 128),  # extra page 128, dual prefill
        SparseMlaConfig("DSV4", 5, 32, 256, 64),  # DSpark decode, topk 256
    }
    return sorted(cells, key=lambda c: c.describe())


@pytest.mark.sparse_mla_requires_sm("==12.*")
@pytest.mark.sparse_mla_requires_cuda_version(">=12.8")
@pytest.mark.sparse_mla_requires_flashinfer(">=0.6.14")
def test_sm120_kernel_probe(sparse_mla_device, sparse_mla_capabilities) -> None:  # type: ignore[no-untyped-def]
    """The real kernel on tiny inputs, one call per cell: supported cells run, unsupported ones
    raise the verdict's builtin base type with exactly its text. Never run on a CPU machine, so
    unverified until a GPU lane runs it."""
    import torch
    from flashinfer.mla._sparse_mla_sm120 import _sparse_mla_sm120_paged_attention

    device = sparse_mla_device
    disagreements = []
    for cell in _probe_cells():
        verdict = supports(cell, sparse_mla_capabilities.flashinfer_version)
        t, h, k, p, e, ep = (cell.num_tokens, cell.num_heads, cell.topk, cell.page_block_size,
                             cell.topk_extra, cell.extra_page_block_size)  # fmt: skip

        def cache(width: int, page: int) -> torch.Tensor:
            return torch.zeros(width // page + 2, page, 584, dtype=torch.uint8, device=device)

        def indices(width: int, t: int = t) -> torch.Tensor:
            return torch.arange(width, dtype=torch.int32, device=device).repeat(t, 1)

        splits = -(-k // 64) + -(-e // 64)
        heads = -(-h // 16) * 16
        kwargs = {
            "topk_length": torch.full((t,), k, dtype=torch.int32, device=device),
            "mid_out": torch.empty(t, heads, splits, 512, dtype=torch.bfloat16, device=device),
            "mid_lse": torch.empty(t, heads, splits, dtype=torch.float32, device=device),
        }
        if cell.dual:
            kwargs.update(
                extra_kv_cache=cache(e, ep),
                extra_indices=indices(e),
                extra_topk_length=torch.full((t,), e, dtype=torch.int32, device=device),
            )
        args = (
            torch.randn(t, h, 512, dtype=torch.bfloat16, device=device),
            cache(k, p),
            indices(k),
            torch.empty(t, h, 512, dtype=torch.bfloat16, device=device),
            torch.empty(t, h, dtype=torch.float32, device=device),
            512**-0.5,
        )
        try:
            _sparse_mla_sm120_paged_attention(*args, **kwargs)
            torch.cuda.synchronize(device)
            got = "runs"
        except (RuntimeError, ValueError) as exc:
            base = "RuntimeError" if isinstance(exc, RuntimeError) else "ValueError"
            got = f"{base}: {exc}"
        if verdict.supported:
            want = "runs"
        else:
            base = "RuntimeError" if issubclass(verdict.error_type, RuntimeError) else "ValueError"
            want = f"{base}: {verdict.error_message}"
        if got != want:
            disagreements.append(f"{cell.describe()}: verdict {want!r}, kernel {got!r}")
    assert not disagreements, "\n".join(disagreements)
