"""Conformance of an implementation's ``page_split``: DSV4 pools of 256- or 128-token pages split to the
64-token pages FlashInfer's SM120 kernels read.

Every test calls the selected implementation's ``page_split(kv_cache, *, src_page_block_size=None,
touched_indices=None, key_suffix="", registry=None)`` (protocol: ``pytest_sparse_mla.implementations``)
and is skipped when it has none. The implementation receives this test's ``registry=``
(``split_buffer_registry`` or a fresh :class:`~pytest_sparse_mla.page_split.BufferRegistry`) and keeps
its destination there, under ``SPLIT_BUFFER_NAME`` and the call's ``key_suffix`` (the protocol's
``registry=``); tests that must see bytes the split should *not* write install a destination
surrounded by canary pages there first.

Every expected byte position is written out by hand from the DSV4 page layout (``ps`` data rows of
576 bytes, then the 8-byte scale records at ``ps*576``; flashinfer-ai/flashinfer
``include/flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh``) and the split rule of
SGLang's ``_split_kv_pages_to_64`` (sgl-project/sglang
``python/sglang/kernels/ops/attention/flash_mla_sm120.py``, PR #27455): source page ``p``, sub-page
``s`` -> destination page ``p*ratio + s``; data ``[s*36864, +36864)`` -> ``[0, 36864)``; footer
``[ps*576 + s*512, +512)`` -> ``[36864, 37376)``; the tail ``[37376, 37440)`` is never written. With
``touched_indices`` (SGLang PR #32320) only the source pages some index ``0 <= t < P*ps`` falls in
are copied, every call decides afresh, and other destination pages keep their bytes. Expected
values are never read back from a split (``formats.unpack_dequantize`` reads source rows only).

CPU cases stay at 1-3 source pages (a Triton implementation runs interpreted there); the pool past
2**31 bytes and the sync check run on CUDA only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from pytest_sparse_mla import formats
from pytest_sparse_mla.page_split import SPLIT_BUFFER_NAME, BufferRegistry

pytestmark = pytest.mark.sparse_mla_needs("page_split")

# Hand constants (bytes): 64 tokens * 576 data bytes, 64 * 8 footer bytes, FlashMLA-padded stride.
DATA = 36_864
SCALE = 512
TAIL_START = 37_376
DST_STRIDE = 37_440
CANARY = 0xA5  # destination bytes a split must not write
FENCE = 0xAB  # the pages just before and after the destination


@dataclass(frozen=True)
class Geometry:
    """One real DSV4 source geometry, with its numbers written out by hand."""

    name: str
    ps: int  # tokens per source page
    src_stride: int  # ceil(ps*584/576)*576
    footer: int  # ps*576: where the scale footer starts
    ratio: int  # ps/64
    num_pages: int  # CPU-sized pool

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.ps

    @property
    def num_dst(self) -> int:
        return self.num_pages * self.ratio


SWA_256 = Geometry("swa_256_to_64", 256, 149_760, 147_456, 4, 2)
EXTRA_128 = Geometry("extra_128_to_64", 128, 74_880, 73_728, 2, 3)
GEOMETRIES = [pytest.param(SWA_256, id=SWA_256.name), pytest.param(EXTRA_128, id=EXTRA_128.name)]
#: Tensor forms; "2d_raw" is SGLang's [P, padded stride] page buffer (explicit page size).
FORMS = ["nhd", "3d", "hnd", "2d", "2d_raw"]


def random_pool(geo: Geometry, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[P, src_stride] random bytes (padding included), drawn on the CPU."""
    shape = (geo.num_pages, geo.src_stride)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(device)


def view_as(pool: torch.Tensor, geo: Geometry, form: str) -> tuple[torch.Tensor, dict]:
    """(cache view in ``form``, page_split kwargs it needs)."""
    if form == "2d_raw":
        return pool, {"src_page_block_size": geo.ps}
    kwargs = {"src_page_block_size": geo.ps} if form == "2d" else {}
    return formats.as_form(pool, "dsv4", geo.ps, form), kwargs


def install_fenced_destination(
    registry: BufferRegistry, device: torch.device, num_dst: int, key_suffix: str = ""
) -> torch.Tensor:
    """Install a CANARY-filled ``[num_dst, 37440]`` destination between two FENCE pages; returns
    the whole ``[num_dst + 2, 37440]`` tensor (rows 1..num_dst are the destination)."""
    big = torch.full((num_dst + 2, DST_STRIDE), CANARY, dtype=torch.uint8, device=device)
    big[0].fill_(FENCE)
    big[-1].fill_(FENCE)
    registry.install(SPLIT_BUFFER_NAME, device, big[1:-1], key_suffix=key_suffix)
    return big


def assert_wrote_into(out: torch.Tensor, big: torch.Tensor) -> None:
    """The split's result is the installed destination, and the fences are intact."""
    assert out.data_ptr() == big[1].data_ptr(), (
        "page_split did not write into the destination installed in its registry= (the protocol keeps "
        f"the split pages in registry under {SPLIT_BUFFER_NAME!r} and the call's key_suffix)"
    )
    assert bool((big[0] == FENCE).all()), "the page before the destination was written"
    assert bool((big[-1] == FENCE).all()), "the page after the destination was written"


def expected_destination(pool: torch.Tensor, geo: Geometry, pages, fill: int = CANARY) -> torch.Tensor:
    """``[P*ratio, 37440]`` bytes a split that copies source ``pages`` leaves in a ``fill``-filled
    destination, from the hand layout: for page p and sub-page s, data ``[s*36864, +36864)`` -> row
    ``p*ratio + s`` bytes ``[0, 36864)``, footer ``[footer + s*512, +512)`` -> ``[36864, 37376)``."""
    out = torch.full((pool.shape[0] * geo.ratio, DST_STRIDE), fill, dtype=torch.uint8, device=pool.device)
    for p in sorted(set(pages)):
        rows = slice(p * geo.ratio, (p + 1) * geo.ratio)
        out[rows, :DATA] = pool[p, : geo.ratio * DATA].view(geo.ratio, DATA)
        out[rows, DATA:TAIL_START] = pool[p, geo.footer : geo.footer + geo.ratio * SCALE].view(geo.ratio, SCALE)
    return out


def assert_destination(dst: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``dst == expected`` ([N, 37440] each), naming the first destination page that differs."""
    if torch.equal(dst, expected):
        return
    bad = (dst != expected).any(dim=1).nonzero().flatten().tolist()
    first = bad[0]
    cols = (dst[first] != expected[first]).nonzero().flatten()
    region = "tail" if int(cols[0]) >= TAIL_START else ("footer" if int(cols[0]) >= DATA else "data")
    raise AssertionError(
        f"{what}: destination pages {bad[:8]}{'...' if len(bad) > 8 else ''} differ from the hand layout; "
        f"page {first} first at byte {int(cols[0])} ({region}), "
        f"{'a page that must not be written was' if bool((expected[first] == CANARY).all()) else 'copy'} wrong"
    )


def page_bytes(out: torch.Tensor, dst_page: int) -> torch.Tensor:
    """The 37,376 bytes (data then footer) of destination page ``dst_page``, read through ``out``."""
    return out[dst_page].reshape(-1)


# --- byte-exact split ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("geo", GEOMETRIES)
def test_footer_round_trip_is_byte_exact(
    geo, form, sparse_mla_impl, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    pool = random_pool(geo, sparse_mla_generator, sparse_mla_device)
    cache, kwargs = view_as(pool, geo, form)
    out = sparse_mla_impl.page_split(cache, registry=split_buffer_registry, **kwargs)

    assert out.dtype == torch.uint8
    assert tuple(out.shape) == (geo.num_dst, 64, 1, 584)
    assert out.stride() == (DST_STRIDE, 584, 584, 1)
    src = pool.reshape(-1)
    for p in range(geo.num_pages):
        for s in range(geo.ratio):
            start = p * geo.src_stride
            want = torch.cat([
                src[start + s * DATA : start + (s + 1) * DATA],
                src[start + geo.footer + s * SCALE : start + geo.footer + (s + 1) * SCALE],
            ])  # fmt: skip
            assert torch.equal(page_bytes(out, p * geo.ratio + s), want), f"source page {p}, sub-page {s}"


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_token_indices_need_no_remapping(geo, sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory):
    cache = packed_kv_cache_factory(num_pages=geo.num_pages, page_block_size=geo.ps, distribution="wide")
    out = sparse_mla_impl.page_split(cache.packed, registry=split_buffer_registry)

    # By hand: token t moves to page (t//ps)*ratio + (t%ps)//64, slot t%64, i.e. flat index t again.
    # And the values agree: flat row t of the split, read as a 64-token cache, is flat row t of the source.
    split_rows = formats.unpack_dequantize(out, page_block_size=64).reshape(cache.num_tokens, 512)
    assert torch.equal(split_rows, cache.flat_dequantized())


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_full_split_writes_no_tail_and_nothing_outside_the_destination(
    geo, sparse_mla_impl, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    pool = random_pool(geo, sparse_mla_generator, sparse_mla_device)
    big = install_fenced_destination(split_buffer_registry, pool.device, geo.num_dst)

    out = sparse_mla_impl.page_split(formats.as_form(pool, "dsv4", geo.ps, "nhd"), registry=split_buffer_registry)

    assert_wrote_into(out, big)
    assert_destination(big[1:-1], expected_destination(pool, geo, range(geo.num_pages)), "full split")


# --- touched pages --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["flat", "2d"])
def test_touched_split_copies_exactly_the_touched_pages(
    dtype, shape, sparse_mla_impl, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    geo = EXTRA_128  # 3 pages of 128 tokens
    pool = random_pool(geo, sparse_mla_generator, sparse_mla_device)
    big = install_fenced_destination(split_buffer_registry, pool.device, geo.num_dst)
    # Tokens 0 and 5 (page 0), 2*128+3 = 259 (page 2), -1 (nothing).
    indices = torch.tensor([0, 5, 259, -1], dtype=dtype, device=pool.device).reshape(shape)

    out = sparse_mla_impl.page_split(
        formats.as_form(pool, "dsv4", geo.ps, "nhd"), touched_indices=indices, registry=split_buffer_registry
    )

    assert_wrote_into(out, big)
    assert_destination(big[1:-1], expected_destination(pool, geo, [0, 2]), "touched pages 0 and 2")


@pytest.mark.parametrize("indices", [None, "empty_int32", "empty_2d_int64"])
def test_none_or_empty_indices_mean_full_split(
    indices, sparse_mla_impl, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    geo = EXTRA_128
    pool = random_pool(geo, sparse_mla_generator, sparse_mla_device)
    big = install_fenced_destination(split_buffer_registry, pool.device, geo.num_dst)
    touched = {
        None: None,
        "empty_int32": torch.empty(0, dtype=torch.int32, device=pool.device),
        "empty_2d_int64": torch.empty(2, 0, dtype=torch.int64, device=pool.device),
    }[indices]

    out = sparse_mla_impl.page_split(
        formats.as_form(pool, "dsv4", geo.ps, "nhd"), touched_indices=touched, registry=split_buffer_registry
    )

    assert_wrote_into(out, big)
    assert_destination(big[1:-1], expected_destination(pool, geo, range(geo.num_pages)), f"indices={indices}")


def test_indices_that_touch_no_page_write_nothing(
    sparse_mla_impl, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    """-1 padding, other negative values and tokens past the pool (3*128 = 384 and beyond) touch
    nothing; a non-empty index tensor is not a full split."""
    geo = EXTRA_128
    pool = random_pool(geo, sparse_mla_generator, sparse_mla_device)
    big = install_fenced_destination(split_buffer_registry, pool.device, geo.num_dst)
    indices = torch.tensor([[-1, -1, -7], [384, 10_000, -(2**40)]], dtype=torch.int64, device=pool.device)

    out = sparse_mla_impl.page_split(
        formats.as_form(pool, "dsv4", geo.ps, "nhd"), touched_indices=indices, registry=split_buffer_registry
    )

    assert_wrote_into(out, big)
    assert_destination(big[1:-1], expected_destination(pool, geo, []), "no page touched")


def test_each_call_copies_only_its_own_touched_pages(
    sparse_mla_impl, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    """The touched set is decided afresh on every call: page 0, touched by the first call only, is
    not copied again by the second (a mask that is not cleared between calls would)."""
    geo = EXTRA_128
    pool = random_pool(geo, sparse_mla_generator, sparse_mla_device)
    cache = formats.as_form(pool, "dsv4", geo.ps, "nhd")
    dev = pool.device
    first = sparse_mla_impl.page_split(
        cache, touched_indices=torch.tensor([3], dtype=torch.int32, device=dev), registry=split_buffer_registry
    )
    for s in range(geo.ratio):
        assert torch.equal(page_bytes(first, s)[:DATA], pool[0, s * DATA : (s + 1) * DATA])

    big = install_fenced_destination(split_buffer_registry, dev, geo.num_dst)
    out = sparse_mla_impl.page_split(
        cache, touched_indices=torch.tensor([300], dtype=torch.int64, device=dev), registry=split_buffer_registry
    )

    assert_wrote_into(out, big)
    assert_destination(big[1:-1], expected_destination(pool, geo, [2]), "second call touches page 2 only")


# Pools for the property test: the first token of page p is p*ps, its last p*ps + ps - 1.
PROPERTY_GEOMETRIES = (
    Geometry("swa_256_x3", 256, 149_760, 147_456, 4, 3),
    Geometry("extra_128_x3", 128, 74_880, 73_728, 2, 3),
)


def _boundary_tokens(geo: Geometry) -> list[int]:
    """First and last token of every source page and of every 64-token sub-page (the pool's first
    and last token among them), and the nearest tokens outside the pool: -1 and ``P*ps``."""
    tokens = {-1, geo.num_tokens}
    for p in range(geo.num_pages):
        for s in range(geo.ratio):
            tokens |= {p * geo.ps + s * 64, p * geo.ps + s * 64 + 63}
    return sorted(tokens)


def _check_touched_split(impl, pool, geo: Geometry, values: list[int], dtype: torch.dtype, rows: int) -> None:  # type: ignore[no-untyped-def]
    """Split ``pool`` with ``values`` as touched indices (``rows`` rows, -1 padded) into a fenced
    canary destination of a fresh registry; compare every byte with the hand layout."""
    registry = BufferRegistry()
    big = install_fenced_destination(registry, pool.device, geo.num_dst)
    width = -(-len(values) // rows)
    flat = values + [-1] * (rows * width - len(values))
    indices = torch.tensor(flat, dtype=dtype, device=pool.device).view(rows, width)

    out = impl.page_split(formats.as_form(pool, "dsv4", geo.ps, "nhd"), touched_indices=indices, registry=registry)

    touched = sorted({t // geo.ps for t in values if 0 <= t < geo.num_tokens})
    assert_wrote_into(out, big)
    assert_destination(big[1:-1], expected_destination(pool, geo, touched), f"{geo.name} indices {values}")


def test_touched_split_writes_exactly_the_touched_pages_property(
    sparse_mla_impl, sparse_mla_generator, sparse_mla_device
):
    """Property (hypothesis): for index sets built from the first and last token of every page,
    sub-page and of the pool, tokens just outside it and arbitrary ones (int32 or int64, 1-3 rows,
    -1 padded), every touched page equals its source bytes and every other destination byte, the
    alignment tails and the pages around the destination keep their canaries."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    pools = {geo.name: random_pool(geo, sparse_mla_generator, sparse_mla_device) for geo in PROPERTY_GEOMETRIES}

    # The boundary sets themselves, whole: every first token, every last token, the pool's ends.
    for geo in PROPERTY_GEOMETRIES:
        pool, n = pools[geo.name], geo.num_tokens
        firsts = [p * geo.ps for p in range(geo.num_pages)]
        lasts = [p * geo.ps + geo.ps - 1 for p in range(geo.num_pages)]
        for values in (firsts, lasts, [0], [n - 1], [n - 1, n], [-1, 0], firsts + lasts):
            _check_touched_split(sparse_mla_impl, pool, geo, values, torch.int32, 1)

    @hypothesis.settings(
        max_examples=20,
        deadline=None,
        suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
    )
    @hypothesis.given(data=st.data())
    def check(data) -> None:  # type: ignore[no-untyped-def]
        geo = data.draw(st.sampled_from(PROPERTY_GEOMETRIES), label="geometry")
        token = st.one_of(
            st.sampled_from(_boundary_tokens(geo)),
            st.integers(min_value=-(2**31), max_value=2**31 - 1),
            st.integers(min_value=-2, max_value=geo.num_tokens + 2),
        )
        values = data.draw(st.lists(token, min_size=1, max_size=24), label="indices")
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype")
        rows = data.draw(st.integers(min_value=1, max_value=3), label="rows")
        _check_touched_split(sparse_mla_impl, pools[geo.name], geo, values, dtype, rows)

    check()


# --- page size 64 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["nhd", "3d", "hnd", "2d"])
def test_page_size_64_is_already_split(form, sparse_mla_impl, split_buffer_registry, sparse_mla_device):
    """A 64-token pool is returned as it is (SGLang returns its ``kv_cache``): no copy, no buffer."""
    pool = torch.zeros((2, DST_STRIDE), dtype=torch.uint8, device=sparse_mla_device)
    cache = formats.as_form(pool, "dsv4", 64, form)
    kwargs = {"src_page_block_size": 64} if form == "2d" else {}
    idx = torch.tensor([0, 70], dtype=torch.int32, device=sparse_mla_device)

    for out in (
        sparse_mla_impl.page_split(cache, registry=split_buffer_registry, **kwargs),
        sparse_mla_impl.page_split(
            cache, touched_indices=idx, key_suffix="_extra", registry=split_buffer_registry, **kwargs
        ),
    ):
        assert out.data_ptr() == cache.data_ptr(), "a 64-token pool was copied"
        assert (tuple(out.shape), out.stride()) == (tuple(cache.shape), cache.stride())
    assert len(split_buffer_registry) == 0 and split_buffer_registry.allocation_log == []


# --- bad geometry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [
        (lambda d: torch.zeros((1, 256, 1, 584), dtype=torch.bfloat16, device=d), {}),
        (lambda d: torch.zeros((1, 96, 584), dtype=torch.uint8, device=d), {}),
        (lambda d: torch.zeros((1, 149_760), dtype=torch.uint8, device=d), {"src_page_block_size": 100}),
    ],
    ids=["bf16-cache", "page-96", "2d-page-100"],
)
def test_refuses_a_pool_it_cannot_split(make, kwargs, sparse_mla_impl, split_buffer_registry, sparse_mla_device):
    """A non-uint8 pool or a page size that is not a multiple of 64 has no 64-token split: it must
    raise (TypeError or ValueError) rather than return misaddressed pages."""
    with pytest.raises((TypeError, ValueError)):
        sparse_mla_impl.bad_call("", make(sparse_mla_device), capability="page_split", registry=split_buffer_registry,
                                 **kwargs)  # fmt: skip


# --- CUDA: offsets past 2**31 bytes, no host sync ----------------------------------------------------

# A pool of 14,340 pages of 149,760 bytes is 2,147,558,400 bytes > 2**31 = 2,147,483,648. Its last
# page (14,339) starts at 14,339*149,760 = 2,147,408,640 and splits into destination pages
# 57,356..57,359; 57,358*37,440 = 2,147,483,520 still fits int32, 57,359*37,440 = 2,147,520,960
# does not (SGLang issue #34025).


def _needs_compiled_kernels() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: interpreted kernels would take hours on this pool")


@pytest.mark.sparse_mla_requires_cuda
@pytest.mark.parametrize("masked", [True, False], ids=["masked", "full"])
def test_split_of_a_pool_past_2_31_bytes_on_gpu(masked, sparse_mla_impl):
    """The 14,340 x 149,760 B pool (2.15 GB) into a 57,360 x 37,440 B destination between two
    fence pages: the four boundary sub-pages of the last source page (SGLang PR #35833's geometry)."""
    _needs_compiled_kernels()
    device = torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(device)
    if free < 12 * 2**30:
        pytest.skip(f"needs ~12 GiB free GPU memory, found {free / 2**30:.1f} GiB")
    geo = Geometry("huge", 256, 149_760, 147_456, 4, 14_340)
    gen = torch.Generator(device=device).manual_seed(34_025)
    pool = torch.randint(0, 256, (geo.num_pages, geo.src_stride), dtype=torch.uint8, device=device, generator=gen)
    registry = BufferRegistry()
    big = install_fenced_destination(registry, device, geo.num_dst)
    indices = None
    if masked:  # a token of the last page only
        indices = torch.tensor([14_339 * 256 + 5, -1], dtype=torch.int64, device=device)

    out = sparse_mla_impl.page_split(
        formats.as_form(pool, "dsv4", 256, "nhd"), touched_indices=indices, registry=registry
    )
    torch.cuda.synchronize()

    assert out.shape[0] == geo.num_dst == 57_360
    assert_wrote_into(out, big)
    copied = [(14_339, s) for s in range(4)]
    if not masked:
        copied += [(0, 0), (7_000, 1), (14_338, 3)]
    for p, s in copied:
        row = big[1 + p * 4 + s]
        assert torch.equal(row[:DATA], pool[p, s * DATA : (s + 1) * DATA]), (p, s)
        assert torch.equal(row[DATA:TAIL_START], pool[p, geo.footer + s * SCALE : geo.footer + (s + 1) * SCALE]), (p, s)
    assert bool((big[1:-1, TAIL_START:] == CANARY).all()), "alignment tail written"
    if masked:
        assert bool((big[1 : geo.num_dst - 3] == CANARY).all()), "a page no index touched was written"


@pytest.mark.sparse_mla_requires_cuda
def test_touched_split_does_not_sync_with_the_host(sparse_mla_impl, packed_kv_cache_factory):
    """No device-to-host synchronisation (torch's sync debug mode ``"error"``): a split inside a
    captured decode step must not read the indices on the host."""
    _needs_compiled_kernels()
    device = torch.device("cuda", torch.cuda.current_device())
    cache = packed_kv_cache_factory(num_pages=3, page_block_size=256, device=device)
    registry = BufferRegistry()
    indices = torch.tensor([[5, 600, -1]], dtype=torch.int32, device=device)  # pages 0 and 2

    def run() -> torch.Tensor:
        return sparse_mla_impl.page_split(cache.packed, touched_indices=indices, registry=registry)

    run()  # allocate buffers, compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = formats.unpack_dequantize(out, page_block_size=64).reshape(-1, 512)
    assert torch.equal(rows[:256], cache.flat_dequantized()[:256])
    assert torch.equal(rows[512:], cache.flat_dequantized()[512:])
