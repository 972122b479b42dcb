"""Conformance against frozen goldens: the selected implementation's packed caches, split pages and
attention outputs on fixed inputs.

Files live under ``golden/suites/test_golden/`` (``--sparse-mla-golden-dir`` points elsewhere);
each reads as JSON in a diff (``pytest_sparse_mla.snapshots``). Every test calls the selected
implementation (``--sparse-mla-impl``) through its protocol and is skipped when it lacks the
capability; the module is skipped when syrupy is not installed.

* Byte layouts are compared exactly (SHA-256 of the bytes, shape, dtype, strides): the
  implementation's ``pack`` of DSV4 sources at page sizes 64/128/256 and a DSV3.2 source, and its
  ``page_split`` of 256/128-token pools with and without touched indices. Inputs are drawn on the
  CPU from the fixed seed of each case (``pytest_sparse_mla.data``; never ``--sparse-mla-seed``) and
  handed to the implementation on ``sparse_mla_device``, so the same files must match on CPU and CUDA.
* Attention: the implementation's ``sparse_mla_forward`` on DeepSeek-V4 per-rank decode and prefill
  calls (``pytest_sparse_mla.deployments``), single and dual cache, with and without ``attn_sink``,
  against the stored outputs of the bundled reference, through the ``sparse_mla_tolerances`` model
  (``check_invariant``: the stored golden is itself a rounded result, so both sides carry their own
  rounding; the bounds are scaled by the float64 oracle's error scales of the same rows). The index
  rows fed in are frozen exactly too, so a drift of the input generators cannot pass as a kernel
  difference. Every float golden is checked against the float64 oracle by
  ``tests/test_golden_storage.py``, so a golden cannot freeze a bug.

Regenerate the files, in one process and with the bundled reference only, when a change is meant to
alter them::

    pytest -p sparse_mla suites/test_golden.py --snapshot-update

(attention goldens are always written from the bundled reference; pack and split goldens from the
selected implementation, which must then be ``reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("syrupy", reason="golden snapshots need syrupy (pip install syrupy): the golden suite is skipped")

from pytest_sparse_mla import data, deployments, formats, snapshots  # noqa: E402
from pytest_sparse_mla.implementations import implementation_name  # noqa: E402
from pytest_sparse_mla.snapshots import close, exact  # noqa: E402


@pytest.fixture(autouse=True)
def _update_only_from_the_reference(request: pytest.FixtureRequest) -> None:
    """``--snapshot-update`` writes what the implementation returns: refuse any but the reference."""
    if not getattr(request.config.option, "update_snapshots", False):
        return
    from pytest_sparse_mla import implementations

    name = implementation_name(implementations.get_implementation(request.config))
    if name != "reference":
        pytest.fail(
            f"--snapshot-update with --sparse-mla-impl {name!r}: goldens are written from the bundled "
            "reference only (run it with --sparse-mla-impl reference)",
            pytrace=False,
        )


# --- packed caches --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackCase:
    """One packed cache: format, page size, pages, data distribution, scale rule, fixed seed."""

    name: str
    fmt: str
    page_block_size: int
    num_pages: int
    seed: int
    distribution: str = "flashinfer"
    scale_rule: str | None = "flashmla"

    def __str__(self) -> str:
        return self.name


PACK_CASES = [
    # DeepSeek-V4 pools: C4 / split SWA pages (64), DeepSeek-V4.1 extra pools (128), SWA pool (256).
    PackCase("dsv4-ps64", "dsv4", 64, 3, seed=601),
    PackCase("dsv4-ps128", "dsv4", 128, 2, seed=602),
    PackCase("dsv4-ps256", "dsv4", 256, 2, seed=603),
    # Group maxima across the 1e-4 scale floor and many exponents, SGLang's writer rule.
    PackCase("dsv4-ps64-wide-sglang", "dsv4", 64, 2, seed=604, distribution="wide", scale_rule="sglang"),
    PackCase("dsv3_2-ps64", "dsv3_2", 64, 2, seed=605),
    # DeepSeek-V4.1 records (their writer rule: scale_rule=None), wide maxima across the floors.
    PackCase("dsv4_1_swa-ps64-wide", "dsv4_1_swa", 64, 2, seed=606, distribution="wide", scale_rule=None),
    PackCase("dsv4_1_indexed-ps64-wide", "dsv4_1_indexed", 64, 2, seed=607, distribution="wide", scale_rule=None),
]


@pytest.mark.sparse_mla_needs("pack")
@pytest.mark.parametrize("case", PACK_CASES, ids=str)
def test_packed_cache_golden(case: PackCase, sparse_mla_impl, sparse_mla_device, tensor_snapshot) -> None:  # type: ignore[no-untyped-def]
    f = formats.get_format(case.fmt)
    generator = torch.Generator().manual_seed(case.seed)
    source = data.latent((case.num_pages, case.page_block_size, f.d_qk), generator, distribution=case.distribution)
    packed = sparse_mla_impl.pack(
        source.to(sparse_mla_device), case.fmt, page_stride="padded", form="nhd", scale_rule=case.scale_rule
    )
    assert packed.device.type == sparse_mla_device.type
    assert tensor_snapshot(name="packed") == exact(packed)


# --- page split -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitCase:
    """A DSV4 pool split to 64-token pages; ``touched`` are flat token indices (None: full split)."""

    name: str
    page_block_size: int
    num_pages: int
    seed: int
    touched: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.name


SPLIT_CASES = [
    SplitCase("swa-256-to-64", 256, 2, seed=701),
    SplitCase("extra-128-to-64", 128, 3, seed=702),
    # Tokens 5 and 600 touch source pages 0 and 2 of 3; -1 marks nothing: destination pages 4..7
    # are never written and hold the fresh scratch's zeros.
    SplitCase("swa-256-to-64-touched", 256, 3, seed=703, touched=(5, 600, -1)),
]


@pytest.mark.sparse_mla_needs("page_split")
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_page_split_golden(
    case: SplitCase, sparse_mla_impl, sparse_mla_device, split_buffer_registry, tensor_snapshot
) -> None:  # type: ignore[no-untyped-def]
    cache = data.make_packed_cache(
        torch.Generator().manual_seed(case.seed),
        num_pages=case.num_pages,
        page_block_size=case.page_block_size,
        page_stride="padded",
        device=sparse_mla_device,
    )
    touched = None
    if case.touched is not None:
        touched = torch.tensor(case.touched, dtype=torch.int32, device=sparse_mla_device)
    out = sparse_mla_impl.page_split(cache.packed, touched_indices=touched, registry=split_buffer_registry)
    assert tuple(out.shape) == (case.num_pages * case.page_block_size // 64, 64, 1, 584)
    assert tensor_snapshot(name="split") == exact(out)


# --- attention ------------------------------------------------------------------------------------

FLASH_TP8 = deployments.MODELS["DeepSeek-V4-Flash"] // 8  # 8 heads per rank
PRO_TP8 = deployments.MODELS["DeepSeek-V4-Pro"] // 8  # 16 heads per rank
FLASH_TP1 = deployments.MODELS["DeepSeek-V4-Flash"]  # 64 heads
PRO_TP1 = deployments.MODELS["DeepSeek-V4-Pro"]  # 128 heads
SM_SCALE = 512**-0.5  # DeepSeek-V4 / FlashInfer's DSV4 tests
PREFILL_TOKENS = deployments.PREFILL_NUM_TOKENS  # 65: the smallest prefill-routed call

#: ``close()`` tolerances the goldens are written and claimed with under ``--snapshot-update``: a
#: re-run of the bundled reference elsewhere (another device or BLAS) may flip one BF16 ulp
#: (``2**-7`` relative at worst) and move an fp32 LSE by ~1e-5 relative; within them the file is kept.
WRITE_TOL = {"output": (1e-6, 2.0**-7 + 1e-5), "lse": (1e-6, 1e-5)}


@dataclass(frozen=True)
class AttentionCase:
    """One DeepSeek-V4 per-rank attention call, drawn from a fixed seed.

    Attributes:
        num_tokens, num_heads, topk: query tokens, heads on the rank, main index width (SWA 128).
        main_pages: 64-token pages of the main (SWA, split) cache.
        sink: draw an ``attn_sink`` (FlashInfer's ``randn(H) * 2``).
        topk_length: per-token valid main prefix lengths, or ``None``.
        extra_topk, extra_page_block_size, extra_pages: the compressed extra cache (C4: 512 @ 64,
            C128: 512 @ 2), or ``extra_topk=0`` for none.
        frozen_tokens: token rows of output and LSE frozen in the golden (``None``: all); prefill
            keeps the first, a middle and the last row so a golden stays a few tens of KiB.
        distribution: of q and the latent rows (``data.DISTRIBUTIONS``). FlashInfer's gives scores
            of about 0.01 and a near-uniform softmax; ``"wide"`` gives peaked ones.
        fmt: the call format (``"dsv4"``, or ``"dsv4_1"``: V4.1 SWA records in the main cache,
            indexed FP4 records in the extra cache).
    """

    name: str
    num_tokens: int
    num_heads: int
    seed: int
    sink: bool
    topk: int = deployments.SWA_TOPK
    main_pages: int = 4
    topk_length: tuple[int, ...] | None = None
    extra_topk: int = 0
    extra_page_block_size: int = deployments.SPLIT_PAGE
    extra_pages: int = 0
    frozen_tokens: tuple[int, ...] | None = None
    distribution: str = "flashinfer"
    fmt: str = "dsv4"

    def __str__(self) -> str:
        return self.name


ATTENTION_CASES = [
    AttentionCase("decode-swa-flash-tp8", 2, FLASH_TP8, seed=801, sink=False),
    AttentionCase("decode-swa-flash-tp8-sink-topk-length", 2, FLASH_TP8, seed=802, sink=True,
                  topk_length=(128, 77)),
    AttentionCase("decode-c4-pro-tp8-sink", 1, PRO_TP8, seed=803, sink=True,
                  extra_topk=deployments.C4_TOPK, extra_pages=4),
    AttentionCase("decode-c128-flash-tp8", 2, FLASH_TP8, seed=804, sink=False,
                  extra_topk=deployments.C128_TOPK, extra_page_block_size=2, extra_pages=128),
    AttentionCase("decode-swa-pro-tp8-wide-sink", 2, PRO_TP8, seed=807, sink=True,
                  distribution="wide"),
    AttentionCase("prefill-swa-flash-tp8-sink", PREFILL_TOKENS, FLASH_TP8, seed=805, sink=True,
                  frozen_tokens=(0, 32, 64)),
    AttentionCase("prefill-c4-flash-tp8", PREFILL_TOKENS, FLASH_TP8, seed=806, sink=False,
                  extra_topk=deployments.C4_TOPK, extra_pages=4, frozen_tokens=(0, 32, 64)),
    # the head counts of head-specialised kernels (FlashMLA's sparse decode: 64 or 128)
    AttentionCase("decode-c4-flash-tp1-sink", 1, FLASH_TP1, seed=808, sink=True,
                  extra_topk=deployments.C4_TOPK, extra_pages=8),
    AttentionCase("decode-swa-pro-tp1-topk-length", 1, PRO_TP1, seed=809, sink=False, topk_length=(101,)),
    # DeepSeek-V4.1: SWA records in the main cache, indexed FP4 records in the C4 extra cache
    AttentionCase("decode-v41-c4-flash-tp8-sink", 2, FLASH_TP8, seed=810, sink=True,
                  extra_topk=deployments.C4_TOPK, extra_pages=4, fmt="dsv4_1"),
]  # fmt: skip

#: Keyword arguments of ``sparse_mla_forward`` with one row per query token.
PER_TOKEN = ("q", "indices", "topk_length", "extra_indices", "extra_topk_length")


def attention_inputs(case: AttentionCase, device: torch.device | str) -> dict:
    """Keyword arguments of ``sparse_mla_forward`` / ``oracle_forward`` for ``case`` on ``device``
    (everything drawn on the CPU from ``case.seed``, in a fixed order)."""
    generator = torch.Generator().manual_seed(case.seed)
    main_fmt, extra_fmt = formats.cache_formats(case.fmt)
    main = data.make_packed_cache(
        generator, fmt=main_fmt, num_pages=case.main_pages, page_block_size=deployments.SPLIT_PAGE,
        page_stride="padded", distribution=case.distribution, device=device,
    )  # fmt: skip
    q_shape = (case.num_tokens, case.num_heads, 512)
    kwargs: dict = {
        "q": data.latent(q_shape, generator, distribution=case.distribution, device=device),
        "kv_cache": main.packed,
        "indices": data.sparse_indices(case.num_tokens, case.topk, main.num_tokens, generator, device=device),
        "sm_scale": SM_SCALE,
    }
    if case.topk_length is not None:
        kwargs["topk_length"] = torch.tensor(case.topk_length, dtype=torch.int32, device=device)
    if case.extra_topk:
        extra = data.make_packed_cache(
            generator, fmt=extra_fmt, num_pages=case.extra_pages, page_block_size=case.extra_page_block_size,
            page_stride="padded", distribution=case.distribution, device=device,
        )  # fmt: skip
        kwargs["extra_kv_cache"] = extra.packed
        kwargs["extra_indices"] = data.sparse_indices(
            case.num_tokens, case.extra_topk, extra.num_tokens, generator, device=device
        )
    if case.sink:
        kwargs["attn_sink"] = data.attn_sink(case.num_heads, generator, device=device)
    if case.fmt != "dsv4":
        kwargs["fmt"] = case.fmt
    return kwargs


def frozen_rows(case: AttentionCase, tensor: torch.Tensor) -> torch.Tensor:
    """The rows of a per-token tensor (output, lse, index rows) that the golden freezes."""
    if case.frozen_tokens is None:
        return tensor
    return tensor[list(case.frozen_tokens)]


def golden_path(config: pytest.Config, test_file, case: AttentionCase, name: str):  # type: ignore[no-untyped-def]
    """Where ``test_attention_golden[case]`` keeps snapshot ``name`` (``"output"``/``"lse"``/``"indices"``)."""
    return snapshots.golden_file(snapshots.golden_root(config), test_file, f"test_attention_golden[{case}]", name)


@pytest.mark.sparse_mla_error_class("goldens")
@pytest.mark.sparse_mla_needs("sparse_mla_forward")
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention_golden(
    case: AttentionCase, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_device, tensor_snapshot, request,
    sparse_mla_envelope,
) -> None:  # type: ignore[no-untyped-def]
    from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward

    env = sparse_mla_envelope
    outside = env.call_reason(
        fmt=case.fmt, num_tokens=case.num_tokens, num_heads=case.num_heads, topk=case.topk,
        extra_topk=case.extra_topk or None, page_block_size=deployments.SPLIT_PAGE,
        extra_page_block_size=case.extra_page_block_size if case.extra_topk else None,
        has_topk_length=case.topk_length is not None, has_sink=case.sink,
    )  # fmt: skip
    if outside is not None:  # a golden freezes one call: it is not refitted
        pytest.skip(f"not applicable to this envelope: {outside}")
    inputs = attention_inputs(case, sparse_mla_device)
    assert tensor_snapshot(name="indices") == exact(inputs["indices"]), "the golden's inputs are no longer drawn"
    with_lse = "flashinfer" in env.lse_conventions  # the goldens hold FlashInfer-convention LSEs
    convention = {} if with_lse or not env.returns_lse else {"lse_convention": "flashmla"}
    res = sparse_mla_impl.sparse_mla_forward(**inputs, **convention)
    t, h = case.num_tokens, case.num_heads
    assert res.output.dtype == torch.bfloat16 and tuple(res.output.shape) == (t, h, 512)
    if with_lse:
        assert res.lse.dtype == torch.float32 and tuple(res.lse.shape) == (t, h)

    updating = bool(getattr(request.config.option, "update_snapshots", False))
    if updating:  # write (or keep) the bundled reference's values; the judgement below uses them
        ref = sparse_mla_forward(**inputs)
        stored = {name: frozen_rows(case, getattr(ref, name)).cpu() for name in ("output", "lse")}
        for name, value in stored.items():
            assert tensor_snapshot(name=name) == close(value, atol=WRITE_TOL[name][0], rtol=WRITE_TOL[name][1])
    else:
        stored = {}
        for name in ("output", "lse"):
            path = golden_path(request.config, request.path, case, name)
            if not path.is_file():
                pytest.fail(f"golden {path} is missing: run `pytest -p sparse_mla {request.path.name} "
                            "--snapshot-update` (one process)", pytrace=False)  # fmt: skip
            stored[name] = snapshots.read_tensor_snapshot(path).values
            # Claims the file for syrupy's unused-snapshot report; the judgement is below.
            assert tensor_snapshot(name=name) == close(stored[name], atol=0.0, rtol=0.0)

    # The oracle treats each token on its own: its error scales of the frozen rows only, on the CPU.
    cpu_inputs = attention_inputs(case, "cpu")
    oracle = oracle_forward(**{k: frozen_rows(case, v) if k in PER_TOKEN else v for k, v in cpu_inputs.items()})
    got = SimpleNamespace(output=frozen_rows(case, res.output).cpu(),
                          lse=frozen_rows(case, res.lse).cpu() if with_lse else None)  # fmt: skip
    golden = SimpleNamespace(output=stored["output"], lse=stored["lse"])
    sparse_mla_tolerances.check_invariant(
        got, golden, oracle=oracle, bitwise=False, what=f"{case} vs the stored golden of the bundled reference"
    )
