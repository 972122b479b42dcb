"""The input space of a sparse-MLA forward call: every dimension, its legal range, where that range
comes from, what the fixed cases draw and what the search draws.

This is the one place the search's ranges live (``pytest_sparse_mla.search`` reads its constants
from here) and the source of ``docs/input-space.md`` (``python -m pytest_sparse_mla.input_space``
prints it; a self-test compares the file with :func:`markdown`). A dimension's ``name`` is the key
under which the search records what it drew (terminal summary, ``--sparse-mla-report-json``
``"search"``).

Pure data: imports neither torch, pytest nor hypothesis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_sparse_mla.envelope import ALL_FORMATS

__all__ = [
    "DIMENSIONS",
    "Dimension",
    "SM_SCALES",
    "SINK_OFFSETS",
    "SCORE_OFFSETS",
    "SCORE_SPREADS",
    "PEAKS",
    "VALUE_EXPONENTS",
    "STALE_VALUES",
    "markdown",
]

#: DeepSeek-V3's YaRN softmax scale: ``qk_head_dim ** -0.5 * mscale ** 2`` with ``qk_head_dim =
#: 192`` and ``mscale = 0.1 * ln(40) + 1`` (deepseek-ai/DeepSeek-V3 ``inference/model.py``, class
#: ``MLA``; released config ``rope_factor = 40``, ``mscale = 1.0``): about 0.1353.
YARN_SM_SCALE = 192**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2

#: Named ``sm_scale`` values the search draws (besides a log-uniform draw over ``[2**-12, 2**4]``):
#: the FlashInfer/FlashMLA test scale of DSV4 and DSV3.2, DeepSeek's YaRN scale, the unscaled
#: ``qk_head_dim ** -0.5``, 1, 0 (every score 0: ties) and a negative scale. The contract
#: (``attention.call.SparseMlaCall.read``) refuses only a non-finite ``sm_scale``.
SM_SCALES: dict[str, float] = {
    "512**-0.5": 512**-0.5,
    "576**-0.5": 576**-0.5,
    "yarn-0.1353": YARN_SM_SCALE,
    "192**-0.5": 192**-0.5,
    "1": 1.0,
    "0": 0.0,
    "-512**-0.5": -(512**-0.5),
}

#: Target standard deviation of a row's logits (natural-log units) the queries are scaled to: 0 is
#: exact ties (queries of zero), then near-uniform, FlashInfer-like, peaked and saturated rows.
SCORE_SPREADS: tuple[float, ...] = (0.0, 1e-3, 0.3, 2.0, 8.0, 40.0)
#: Common offset added to every logit of a row (through a key component shared by every cache row):
#: strongly negative rows (every candidate irrelevant), near zero, strongly positive rows whose LSE
#: passes ``ln(FLT_MAX) = 88.72``.
SCORE_OFFSETS: tuple[float, ...] = (-3000.0, -200.0, -30.0, 0.0, 30.0, 200.0, 3000.0)
#: The dominant candidate's logit above the others for a peaked row.
PEAKS: tuple[float, ...] = (8.0, 30.0, 100.0)
#: ``attn_sink`` offsets from the row's LSE without sink (natural log), per head; ``-inf`` is drawn
#: separately (no mass at all).
SINK_OFFSETS: tuple[float, ...] = (-1000.0, -40.0, -3.0, 0.0, 3.0, 40.0, 1000.0)
#: Powers of two multiplying a cache's latent rows (the NoPE part: every UE8M0 scale byte from far
#: below 127 to far above it; ``formats.NOPE_OVERFLOW`` is the top) and, separately, the BF16 RoPE
#: part. Group magnitudes within a row spread a further ``2**-24 .. 2**8`` when ``wide``.
VALUE_EXPONENTS: tuple[int, int] = (-40, 100)
#: What a lane past ``topk_length`` holds: FlashInfer's stale padding ``1 << 30``, a poisoned
#: in-range slot (slot 0, the last slot, an unreferenced one), or ``-1``.
STALE_VALUES: tuple[str, ...] = ("1<<30", "poisoned-slot", "-1")


@dataclass(frozen=True)
class Dimension:
    """One dimension of a call.

    Attributes:
        name: the key the search records its draws under.
        legal: the legal range, in words.
        source: where that range comes from (public repository + path, paper, or this package's
            written contract).
        fixed: what the fixed cases (``attention.cases``, the suites) draw.
        search: what the search (``pytest_sparse_mla.search``) draws, inside the implementation's
            envelope.
        ends: the ends of the legal range every search run draws (``pytest_sparse_mla.covering``:
            its covering calls, inside the envelope; its self-test reads a run's record of them).
    """

    name: str
    legal: str
    source: str
    fixed: str
    search: str
    ends: str = "-"


_CONTRACT = "this package's contract (`attention.call.SparseMlaCall.read`, `Envelope`)"

#: Every dimension of a ``sparse_mla_forward`` call, in the order of ``docs/input-space.md``.
DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        "fmt",
        ", ".join(f"`{name}`" for name in ALL_FORMATS),
        "`formats.CALL_FORMATS`; FlashMLA MODEL1/V32, flashinfer-python 0.7.2.post1 V4.1 reference",
        "all three",
        "every format of the envelope",
        ends="every format of the envelope",
    ),
    Dimension(
        "num_tokens",
        "any `T >= 0`; decode `T <= 64`, prefill above",
        "FlashInfer `_DECODE_MAX_TOKENS = 64` (`flashinfer/mla/_sparse_mla_sm120`)",
        "1, 2, 4, 8, 16, 63, 64, 65, 80, 128 (CUDA: up to 4096)",
        "1..64 and 65..96 (CPU), 65..300 (CUDA), 64 and 65 weighted, inside `[min_tokens, max_tokens]`",
        ends="0, 1, 64 (decode), 65 and 512 (CUDA: 4096) (prefill), inside the envelope",
    ),
    Dimension(
        "num_heads",
        "any `H >= 1`",
        _CONTRACT + "; FlashMLA takes 64/128",
        "1, 5, 8, 16, 17, 32, 33, 64, 128",
        "1..40, 64, 128, 192, 256 (the envelope's list where it has one)",
        ends="1, 17 (a partial tile of 16) and 256; the envelope's fewest and most",
    ),
    Dimension(
        "topk",
        "any width `>= 1` the envelope's `Widths` take",
        _CONTRACT,
        "64..2048, mostly 128",
        "1..320 (CPU), 1..1100 (CUDA), rounded to the envelope's multiple",
        ends="the narrowest and the widest row the envelope takes, up to 2048",
    ),
    Dimension(
        "topk_length",
        "any int32 (clamped to `[0, topk]`), or `[0, topk]` for `topk_length_range='row'`",
        "FlashInfer `compressed_sparse_mla_reference`; FlashMLA `sparse_decode.h`",
        "none, 0, 100, 128, 133, 200 (one value for every token)",
        "none, or per token in `[-3, topk + 3]` (`row`: `[0, topk]`), 0 and `topk` weighted",
        ends="0, the row width, and `-2**31`, `2**31 - 1` where any int32 is clamped",
    ),
    Dimension(
        "masked_lanes",
        "`-1` masks a lane; every negative for `masked_indices='negative'`",
        _CONTRACT + "; FlashMLA decode masks only -1",
        "the trailing fraction of a row is -1",
        "trailing or scattered -1 (or -2, INT32_MIN where every negative masks), whole rows masked",
        ends="whole rows, `-1`, `-2**31` (where every negative masks)",
    ),
    Dimension(
        "index_pattern",
        "any slot in `[0, num_pages * page_block_size)`, duplicates allowed",
        _CONTRACT,
        "uniform over the cache (duplicates by chance), slot 0 and the last slot avoided in the poison test",
        "uniform, few distinct slots (duplicates), the first and last slot, one page",
        ends="the first and last slot; duplicates",
    ),
    Dimension(
        "stale_lanes",
        "lanes past `topk_length` hold anything and must not be read",
        "flashinfer-ai/flashinfer #5193 (stale padding)",
        "`1 << 30`, or poisoned slots in one test",
        "`1 << 30`, a poisoned in-range slot, or -1, per lane",
        ends="each filler",
    ),
    Dimension(
        "page_block_size",
        "any `>= 1` the envelope takes (main and extra)",
        "`formats.parse_cache`; DeepSeek-V4 serves 256 (main) and 64/2 (C4/C128 extra)",
        "main 64, 128, 256; extra 2, 64",
        "main 1, 2, 3, 16, 48, 64, 96, 128, 256; extra 1, 2, 3, 4, 48, 64 (envelope's list)",
        ends="1 and 256 per cache (the envelope's smallest and largest)",
    ),
    Dimension("num_pages", "any `>= 1`", _CONTRACT, "1..1024", "1..12 main, 1..64 extra (at least one slot per lane)"),
    Dimension(
        "extra_cache",
        "absent, or a second cache in one softmax with the main one",
        "FlashInfer `compressed_sparse_mla_reference` (`extra_k_cache`)",
        "C4 (page 64) and C128 (page 2)",
        "absent or present with its own width, page size, lengths, layout and magnitude",
        ends="absent and present",
    ),
    Dimension(
        "value_exponent",
        "NoPE: any value below `formats.NOPE_OVERFLOW` (UE8M0 bytes 0..254); RoPE: any finite BF16",
        "`formats.quantize_pack`; OCP MX spec (E8M0)",
        "`(randn/10).clamp(-1,1)`, scaled by `2**-6`/`2**6` in two cases; `wide`: groups `2**-24..2**8`",
        f"per cache a power of two in `2**{VALUE_EXPONENTS[0]}..2**{VALUE_EXPONENTS[1]}`, RoPE separately, "
        "groups spread `2**-24..2**8` when `wide`",
        ends="`2**-40` and `2**100`, NoPE and RoPE",
    ),
    Dimension(
        "score_spread",
        "any finite logits",
        "the softmax",
        "about 0.01 (random), peaked 8 and 30",
        f"standard deviation {', '.join(str(s) for s in SCORE_SPREADS)} natural-log units",
        ends="0 and 40",
    ),
    Dimension(
        "score_offset",
        "any finite logits; an LSE may pass `ln(FLT_MAX) = 88.72`",
        "the softmax",
        "about 0",
        f"{', '.join(str(s) for s in SCORE_OFFSETS)} added to every logit of a row",
        ends="-3000 and 3000",
    ),
    Dimension(
        "peak",
        "any",
        "the softmax",
        "8 and 30",
        f"none, or one candidate {', '.join(str(p) for p in PEAKS)} above the others",
        ends="100",
    ),
    Dimension(
        "sm_scale",
        "any finite number",
        "`SparseMlaCall.read`; DeepSeek-V3 `inference/model.py` (YaRN)",
        "`d_qk ** -0.5` only",
        f"{', '.join(SM_SCALES)}, and log-uniform `2**-12..2**4`",
        ends="0, negative (beside the widest spread), `2**-12`, `2**4`",
    ),
    Dimension(
        "attn_sink",
        "none, or `[H]` fp32 from `-inf` to any finite value",
        "OpenAI gpt-oss sinks; FlashInfer `compressed_sparse_mla_reference`",
        "`randn(H) * 2`, the median LSE +- 1, `-inf` on even heads",
        f"none, or per head `-inf` or the row LSE + {', '.join(str(s) for s in SINK_OFFSETS)}",
        ends="`-inf`, the row LSE - 1000 and + 1000",
    ),
    Dimension(
        "lse_convention",
        "`flashinfer` (log2, sink included, times `lse_scale`) or `flashmla` (natural log, sink excluded)",
        "flashinfer-ai/flashinfer #5203, #4650; FlashMLA `flash_mla_interface.py`",
        "both, on 8-16 tokens (decode) only",
        "each the envelope honours, on both routes, `lse_scale` 1, ln 2, 0.5",
        ends="each convention on both routes",
    ),
    Dimension(
        "cache_form",
        "`2d`, `3d`, `hnd`, `nhd`",
        "`formats.FORMS`",
        "nhd mostly; one case each of the others",
        "any of the four, per cache",
        ends="all four",
    ),
    Dimension(
        "page_stride",
        "tight, padded or any multiple of 16 bytes `>= ps * bytes_per_token`",
        "`formats.page_stride_bytes`; FlashInfer's stride check",
        "tight and padded",
        "tight, padded, or padded + 16..256 bytes",
        ends="tight, padded, padded + 256 B",
    ),
    Dimension(
        "storage_offset",
        "any (a layer of a per-layer pool, a view into a larger allocation)",
        "serving engines' per-layer pools (SGLang, vLLM)",
        "layer 1..3 of 2..4",
        "layer 0..3 of 1..4, with poisoned other layers and canary bytes before and after",
        ends="the last layer of a 4-layer pool",
    ),
    Dimension(
        "query_layout",
        "any strided view",
        "a slice of a fused QKV projection",
        "one test: a head and token stride view",
        "contiguous, or a view with padded head and token strides",
        ends="contiguous and strided",
    ),
    Dimension(
        "scale_bytes",
        "UE8M0 bytes 0..254, E4M3 scales 2**-9..448, positive finite fp32 scales (`formats.check_scales`)",
        "OCP MX spec (E8M0); `formats.check_scales`",
        "what the packer writes",
        "what the packer writes, or every stored record's scales at the format's smallest or largest encodable "
        "scale (`search.SCALE_ENDS`; with the largest, E4M3 codes of at most `3 * 2**-9` and at most 256 lanes)",
        ends="each record format's smallest and largest encodable scale",
    ),
    Dimension(
        "pool_bytes",
        "page offsets past `2**31` bytes (pools larger than 2 GiB)",
        "an 80-141 GB GPU serving long contexts",
        "not drawn",
        "random draws: small pools (recorded as `small`)",
        ends="CUDA: layer 59 of a 60-layer pool whose last read page starts past `2**31` bytes (2 GiB a call: "
        "not on a CPU)",
    ),
)


def markdown() -> str:
    """``docs/input-space.md``: one table row per :data:`DIMENSIONS` entry."""
    lines = [
        "# The input space of a sparse-MLA call",
        "",
        "Generated from `pytest_sparse_mla/input_space.py` (`python -m pytest_sparse_mla.input_space`); a",
        "self-test compares this file with the model. The search (`suites/test_attention_search.py`,",
        "`pytest_sparse_mla.search`) draws every call inside the implementation's `Envelope`; every run",
        "first draws the ends of the last column (`pytest_sparse_mla.covering`; a self-test reads a",
        "default run's record of them).",
        "",
        "| dimension | legal range | source | fixed cases draw | the search draws | ends every run draws |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for d in DIMENSIONS:
        lines.append(f"| `{d.name}` | {d.legal} | {d.source} | {d.fixed} | {d.search} | {d.ends} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(markdown(), end="")
