"""Golden snapshots: frozen bytes of packed caches and split pages, frozen reference attention outputs.

Files live under ``golden/suites/test_golden/`` (``--sparse-mla-golden-dir`` points elsewhere);
each reads as JSON in a diff (``pytest_sparse_mla.snapshots``). Regenerate them, in one process,
only when a change is meant to alter them::

    pytest -p sparse_mla suites/test_golden.py --snapshot-update

* Byte layouts are compared exactly (SHA-256 of the bytes, shape, dtype, strides): packed DSV4
  caches at page sizes 64/128/256 and DSV3.2 (``formats.quantize_pack``), the 256/128 -> 64 page
  split with and without a touched-page mask (``page_split``), and the index rows fed to
  attention. Inputs are drawn on the CPU from the fixed seed of each case (``pytest_sparse_mla.data``;
  never ``--sparse-mla-seed``) and packed / split on ``sparse_mla_device``, so the same files
  must match on CPU and CUDA.
* Reference attention outputs (``pytest_sparse_mla.attention.sparse_mla_forward``) for decode and
  prefill, single and dual cache, with and without ``attn_sink``, at DeepSeek-V4 per-rank shapes
  (``pytest_sparse_mla.deployments``) are compared within a tolerance that covers a one-ulp BF16
  flip from a different fp32 summation order. Honesty: every float golden, decoded from its file,
  is checked against the float64 oracle computed afresh (``test_float_golden_matches_the_oracle``),
  and ``test_every_float_golden_is_checked_against_the_oracle`` fails on a float golden no
  honesty case covers, so a golden cannot quietly freeze a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pytest_sparse_mla import data, deployments, formats, snapshots, tolerances
from pytest_sparse_mla.snapshots import close, exact

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
    scale_rule: str = "flashmla"

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
]


@pytest.mark.parametrize("case", PACK_CASES, ids=str)
def test_packed_cache_golden(case: PackCase, sparse_mla_device: torch.device, tensor_snapshot) -> None:
    f = formats.get_format(case.fmt)
    generator = torch.Generator().manual_seed(case.seed)
    source = data.latent(
        (case.num_pages, case.page_block_size, f.d_qk), generator, distribution=case.distribution
    )
    packed = formats.quantize_pack(
        source.to(sparse_mla_device), f, page_stride="padded", form="nhd", scale_rule=case.scale_rule
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
    # keep the fresh registry's zeros.
    SplitCase("swa-256-to-64-touched", 256, 3, seed=703, touched=(5, 600, -1)),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_page_split_golden(
    case: SplitCase, sparse_mla_device: torch.device, split_buffer_registry, tensor_snapshot
) -> None:
    from pytest_sparse_mla.page_split import page_split

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
    out = page_split(cache.packed, touched_indices=touched, registry=split_buffer_registry)
    assert tuple(out.shape) == (case.num_pages * case.page_block_size // 64, 64, 1, 584)
    assert tensor_snapshot(name="split") == exact(out)


# --- reference attention --------------------------------------------------------------------------

FLASH_TP8 = deployments.MODELS["DeepSeek-V4-Flash"] // 8  # 8 heads per rank
PRO_TP8 = deployments.MODELS["DeepSeek-V4-Pro"] // 8  # 16 heads per rank
SM_SCALE = 512**-0.5  # DeepSeek-V4 / FlashInfer's DSV4 tests
PREFILL_TOKENS = deployments.PREFILL_NUM_TOKENS  # 65: the smallest prefill-routed call

#: Tolerances of pure-PyTorch fp32 references (``tolerances.DEFAULT_PROFILES["tight"]``).
#: Golden vs. the same reference on another device or BLAS: "self" keys, one BF16 ulp (2**-7
#: relative at worst) from a different fp32 summation order. Stored golden vs. the float64 oracle:
#: BF16 rounding (half an ulp, 2**-8 relative) plus fp32 error (1e-5 relative).
TIGHT = tolerances.DEFAULT_PROFILES["tight"]
GOLDEN_TOL = {"output": TIGHT["self_output"], "lse": TIGHT["self_lse"]}
ORACLE_TOL = {"output": TIGHT["output"], "lse": TIGHT["lse"]}


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
            keeps the first, a middle and the last row (one per 32-token chunk of the reference on
            CPU) so a golden stays a few tens of KiB.
        distribution: of q and the latent rows (``data.DISTRIBUTIONS``). FlashInfer's gives scores
            of about 0.01 and a near-uniform softmax; ``"wide"`` gives peaked ones.
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
]


def attention_inputs(case: AttentionCase, device: torch.device | str) -> dict:
    """Keyword arguments of ``sparse_mla_forward`` / ``oracle_forward`` for ``case`` on ``device``
    (everything drawn on the CPU from ``case.seed``, in a fixed order)."""
    generator = torch.Generator().manual_seed(case.seed)
    main = data.make_packed_cache(
        generator, num_pages=case.main_pages, page_block_size=deployments.SPLIT_PAGE,
        page_stride="padded", distribution=case.distribution, device=device,
    )
    q_shape = (case.num_tokens, case.num_heads, 512)
    kwargs: dict = {
        "q": data.latent(q_shape, generator, distribution=case.distribution, device=device),
        "kv_cache": main.packed,
        "indices": data.sparse_indices(
            case.num_tokens, case.topk, main.num_tokens, generator, device=device
        ),
        "sm_scale": SM_SCALE,
    }
    if case.topk_length is not None:
        kwargs["topk_length"] = torch.tensor(case.topk_length, dtype=torch.int32, device=device)
    if case.extra_topk:
        extra = data.make_packed_cache(
            generator, num_pages=case.extra_pages, page_block_size=case.extra_page_block_size,
            page_stride="padded", distribution=case.distribution, device=device,
        )
        kwargs["extra_kv_cache"] = extra.packed
        kwargs["extra_indices"] = data.sparse_indices(
            case.num_tokens, case.extra_topk, extra.num_tokens, generator, device=device
        )
    if case.sink:
        kwargs["attn_sink"] = data.attn_sink(case.num_heads, generator, device=device)
    return kwargs


def _frozen_rows(case: AttentionCase, tensor: torch.Tensor) -> torch.Tensor:
    """The rows of a per-token tensor (output, lse, index rows) that the golden freezes."""
    if case.frozen_tokens is None:
        return tensor
    return tensor[list(case.frozen_tokens)]


_PER_TOKEN = ("q", "indices", "topk_length", "extra_indices", "extra_topk_length")


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention_golden(case: AttentionCase, sparse_mla_device: torch.device, tensor_snapshot) -> None:
    from pytest_sparse_mla.attention import route_for, sparse_mla_forward

    inputs = attention_inputs(case, sparse_mla_device)
    res = sparse_mla_forward(**inputs)
    assert res.route == route_for(case.num_tokens) == case.name.split("-")[0]
    assert tensor_snapshot(name="indices") == exact(inputs["indices"])
    for name, value in (("output", res.output), ("lse", res.lse)):
        tol = GOLDEN_TOL[name]
        frozen = _frozen_rows(case, value)
        assert tensor_snapshot(name=name) == close(frozen, atol=tol.atol, rtol=tol.rtol)


# --- honesty: float goldens against the float64 oracle ----------------------------------------


def _golden(request: pytest.FixtureRequest, case: AttentionCase, name: str) -> snapshots.TensorRecord:
    path = snapshots.golden_file(
        snapshots.golden_root(request.config), request.path, f"test_attention_golden[{case}]", name
    )
    if not path.is_file():
        pytest.fail(f"golden {path} is missing: run `pytest -p sparse_mla {request.path.name} "
                    "--snapshot-update` (one process)", pytrace=False)
    return snapshots.read_tensor_snapshot(path)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_float_golden_matches_the_oracle(case: AttentionCase, request: pytest.FixtureRequest) -> None:
    from pytest_sparse_mla.attention.oracle import oracle_forward

    inputs = attention_inputs(case, "cpu")
    # The oracle treats each token on its own, so it only needs the frozen tokens.
    oracle = oracle_forward(**{
        key: _frozen_rows(case, value) if key in _PER_TOKEN else value
        for key, value in inputs.items()
    })
    for name, expected in (("output", oracle.output), ("lse", oracle.lse)):
        golden = _golden(request, case, name)
        assert golden.dtype == {"output": torch.bfloat16, "lse": torch.float32}[name]
        assert golden.shape == tuple(expected.shape)
        assert bool(torch.isfinite(golden.values).all())  # every case has valid candidates
        tol = ORACLE_TOL[name]
        torch.testing.assert_close(
            golden.values.double(), expected, atol=tol.atol, rtol=tol.rtol,
            msg=lambda m, name=name: f"stored golden {name!r} vs. float64 oracle: {m}",
        )


def test_every_float_golden_is_checked_against_the_oracle(request: pytest.FixtureRequest) -> None:
    root = snapshots.golden_root(request.config)
    checked = {
        snapshots.golden_file(root, request.path, f"test_attention_golden[{case}]", name)
        for case in ATTENTION_CASES
        for name in ("output", "lse")
    }
    module_dir = next(iter(checked)).parent
    floats = {
        path
        for path in module_dir.glob(f"*.{snapshots.FILE_EXTENSION}")
        if snapshots.read_tensor_snapshot(path).compare == "close"
    }
    assert floats, f"no float goldens under {module_dir}"
    unchecked = sorted(p.name for p in floats - checked)
    assert not unchecked, f"float goldens no oracle test covers: {unchecked}"
