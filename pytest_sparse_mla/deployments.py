"""DeepSeek-V4 deployment shapes as data: which sparse-MLA calls real servers make per rank.

Pure data: no torch, and nothing of the package (the dispatch grid's config of a deployment's
call is ``pytest_sparse_mla.dispatch.report.deployment_config``). Every shape is what FlashInfer's
SM120 backend sees on one tensor-parallel rank, after SGLang's page split (256-token pool pages ->
64-token pages for the main/SWA cache):

==========================  =======  =====  =====================  =================================
layer (cache role)          heads    topk   page_block_size        extra cache (extra_topk @ page)
==========================  =======  =====  =====================  =================================
SWA (window-only)           H / TP   128    64                     none
C4 (SWA + C4 compressed)    H / TP   128    64                     512 @ 64   (256 / 4)
C128 (SWA + C128)           H / TP   128    64                     512 @ 2    (256 / 128)
DSpark draft                64 / TP  192    64                     none
DSpark draft, SGLang pad    64       192    64                     none
==========================  =======  =====  =====================  =================================

H = 64 (DeepSeek-V4-Flash) or 128 (DeepSeek-V4-Pro); TP in {1, 2, 4, 8}; C128's 512 stands for a
64K-token context. Sources: heads, deepseek-ai/DeepSeek-V4-Flash config and sgl-project/sglang PR
#27954, ``n_local_heads = n_heads // attn_tp_size`` (``python/sglang/srt/models/deepseek_v4.py``);
widths and compressed pages (``page_size // compress_ratio``), ``python/sglang/srt/layers/attention/
compressed/metadata.py``; page split, PR #27455; DSpark 192 and ``_PAD_NUM_HEADS = 64``,
sgl-project/sglang #33943, #34717 and ``python/sglang/srt/models/deepseek_v4_dspark.py``,
flashinfer-ai/flashinfer PR #4380. Derivations and the reported failing shapes:
``docs/design/flashinfer-dispatch.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "TENSOR_PARALLEL_SIZES", "PHASES", "PREFILL_NUM_TOKENS", "Deployment", "DEPLOYMENTS",
           "deployments"]  # fmt: skip

#: total query heads per model (sources in the module docstring).
MODELS: dict[str, int] = {"DeepSeek-V4-Flash": 64, "DeepSeek-V4-Pro": 128}
#: attention tensor-parallel sizes covered.
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
#: phases of a deployment; decode is ``num_tokens <= 64``, prefill ``num_tokens > 64``.
PHASES = ("decode", "prefill")
#: num_tokens of a prefill call: the smallest prefill-sized call. Every release gives every
#: ``num_tokens > 64`` the same verdict, so one value stands for all prefill chunks.
PREFILL_NUM_TOKENS = 65
#: SWA window width (main index row), tokens.
SWA_TOPK = 128
#: main-cache page size after SGLang's 256 -> 64 split, tokens.
SPLIT_PAGE = 64
#: SGLang pool page size, tokens.
POOL_PAGE = 256
#: C4 sparse index width (``c4_sparse_topk``).
C4_TOPK = 512
#: representative C128 dense width: a 64K-token context / 128.
C128_TOPK = 65536 // 128
#: DSpark draft index width: 128 window + 5-token block, padded to a multiple of 64.
DSPARK_TOPK = 192
#: DSpark tokens per request in decode (gamma 5 + 1).
DSPARK_DECODE_TOKENS = 6
#: heads SGLang pads the DSpark query to.
DSPARK_PAD_HEADS = 64


@dataclass(frozen=True)
class Deployment:
    """One DeepSeek-V4 attention call family on one rank.

    Attributes:
        model: ``"DeepSeek-V4-Flash"`` or ``"DeepSeek-V4-Pro"``.
        layer: cache role: ``"SWA"``, ``"C4"``, ``"C128"``, ``"DSpark draft"`` or
            ``"DSpark draft (SGLang 64-head pad)"``.
        tp: attention tensor-parallel size.
        num_heads: query heads the kernel sees on one rank (after any padding).
        topk: main (SWA) index width, tokens.
        page_block_size: main-cache page size after the split, tokens.
        extra_topk: extra (compressed) index width, 0 for single-cache layers.
        extra_page_block_size: extra-cache page size, tokens; 0 for single-cache layers.
        decode_num_tokens: rows of a decode call (1; DSpark verify: gamma + 1 = 6).
    """

    model: str
    layer: str
    tp: int
    num_heads: int
    topk: int
    page_block_size: int
    extra_topk: int = 0
    extra_page_block_size: int = 0
    decode_num_tokens: int = 1

    @property
    def key(self) -> str:
        """Stable id, e.g. ``"DeepSeek-V4-Flash/C4/TP2"``."""
        return f"{self.model}/{self.layer}/TP{self.tp}"

    def num_tokens(self, phase: str) -> int:
        """Rows of one call in ``phase`` (``"decode"`` or ``"prefill"``).

        Raises:
            ValueError: unknown phase.
        """
        if phase == "decode":
            return self.decode_num_tokens
        if phase == "prefill":
            return PREFILL_NUM_TOKENS
        raise ValueError(f"phase={phase!r}: expected one of {', '.join(PHASES)}")


def deployments() -> tuple[Deployment, ...]:
    """Every covered deployment: both models x {SWA, C4, C128} x TP, then the V4-Flash DSpark
    draft x TP (exact local heads, then SGLang's 64-head pad)."""
    out: list[Deployment] = []
    for model, heads in MODELS.items():
        for tp in TENSOR_PARALLEL_SIZES:
            local = heads // tp
            out.append(Deployment(model, "SWA", tp, local, SWA_TOPK, SPLIT_PAGE))
            out.append(
                Deployment(model, "C4", tp, local, SWA_TOPK, SPLIT_PAGE, C4_TOPK, POOL_PAGE // 4)
            )
            out.append(
                Deployment(
                    model, "C128", tp, local, SWA_TOPK, SPLIT_PAGE, C128_TOPK, POOL_PAGE // 128
                )
            )
    flash = "DeepSeek-V4-Flash"
    for tp in TENSOR_PARALLEL_SIZES:
        out.append(
            Deployment(
                flash, "DSpark draft", tp, MODELS[flash] // tp, DSPARK_TOPK, SPLIT_PAGE,
                decode_num_tokens=DSPARK_DECODE_TOKENS,
            )
        )  # fmt: skip
    for tp in TENSOR_PARALLEL_SIZES:
        out.append(
            Deployment(
                flash, "DSpark draft (SGLang 64-head pad)", tp,
                max(MODELS[flash] // tp, DSPARK_PAD_HEADS), DSPARK_TOPK, SPLIT_PAGE,
                decode_num_tokens=DSPARK_DECODE_TOKENS,
            )
        )  # fmt: skip
    return tuple(out)


#: :func:`deployments`, computed once.
DEPLOYMENTS: tuple[Deployment, ...] = deployments()
