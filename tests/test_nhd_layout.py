"""NHDLayout against plain per-element indexing of the FlashAttention cache.

Caches are made the way vLLM 0.32 makes them (``create_kv_cache_views`` over
an int8 buffer, second of two layers so offsets and strides are not trivial)
for the default FlashAttention layout LBNHC and for LBHNC / BLNHC, plus the
pre-0.32 ``(2, NB, BS, H, D)`` tensor. The reference is the logical definition:
token at (block b, offset o) of head h has K = ``kv[b, h, o, :D]`` and
V = ``kv[b, h, o, D:]`` (legacy: ``kv[0|1, b, o, h]``), read one element row
at a time in Python loops.
"""
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm_kvevict.core.layouts.nhd_layout import NHDLayout

D, NB = 8, 10
GRID = [(dt, h, bs, "LBNHC") for dt, h, bs in
        itertools.product((torch.float32, torch.bfloat16), (1, 2, 4), (16, 32))]
GRID += [(torch.bfloat16, 2, 16, lay) for lay in ("LBHNC", "BLNHC", "legacy5d")]
GRID += [(torch.float32, 4, 32, lay) for lay in ("LBHNC", "BLNHC", "legacy5d")]
IDS = [f"{str(dt)[6:]}-h{h}-bs{bs}-{lay}" for dt, h, bs, lay in GRID]


def make_cache(dtype, h, bs, layout, seed=0):
    """A random layer cache in vLLM 0.32's logical ``[NB, H, BS, 2D]`` view."""
    g = torch.Generator().manual_seed(seed)
    if layout == "legacy5d":
        kv = torch.empty(2, NB, bs, h, D, dtype=dtype)
    else:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheTensor,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout

        spec = FullAttentionSpec(block_size=bs, num_kv_heads=h, head_size=D, dtype=dtype)
        page, layers = spec.page_size_bytes, 2
        lay = KVCacheLayout[layout]
        strides = (page, page * layers) if lay.is_block_outermost else (page * NB, page)
        raw = torch.zeros(page * NB * layers, dtype=torch.int8)
        t = KVCacheTensor(size=raw.numel(), layers=["l0", "l1"], layer_stride=strides[0],
                          block_stride=strides[1])
        kv = create_kv_cache_views(raw, spec, NB, lay, t)[1]
        assert kv.shape == (NB, h, bs, 2 * D)
    kv.copy_(torch.randn(kv.shape, generator=g).to(dtype))
    return kv


def ref_kv(kv, b, o, h):
    """(K, V) rows ``[D]`` of one token, from the logical definition."""
    if kv.dim() == 5:
        return kv[0, b, o, h], kv[1, b, o, h]
    return kv[b, h, o, :D], kv[b, h, o, D:]


def distinct_slots(h, n, bs, seed):
    """[H, N] block ids and offsets, distinct within each head."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(NB * bs, generator=g)[:n] for _ in range(h)])
    return slots // bs, slots % bs


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_split_is_what_flash_attention_reads(dtype, h, bs, layout):
    kv = make_cache(dtype, h, bs, layout)
    lay = NHDLayout.for_cache(kv)
    assert (lay.block_size, lay.num_kv_heads, lay.head_size, lay.dtype) == (bs, h, D, dtype)
    kc, vc = lay.split(kv)
    assert kc.shape == vc.shape == (NB, bs, h, D)
    for b, o, hh in [(0, 0, 0), (NB - 1, bs - 1, h - 1), (3, bs // 2, h // 2)]:
        rk, rv = ref_kv(kv, b, o, hh)
        assert torch.equal(kc[b, o, hh], rk) and torch.equal(vc[b, o, hh], rv)
    if kv.dim() == 4:  # the exact expression in flash_attn.py's forward
        fk, fv = kv.transpose(1, 2).split(D, dim=-1)
        assert (kc.stride(), kc.data_ptr()) == (fk.stride(), fk.data_ptr())
        assert (vc.stride(), vc.data_ptr()) == (fv.stride(), fv.data_ptr())
    kc[1, 2 % bs, h - 1] = 7.0  # views: a write lands in the layer cache
    assert bool((ref_kv(kv, 1, 2 % bs, h - 1)[0] == 7.0).all())


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_read_tokens(dtype, h, bs, layout):
    kv = make_cache(dtype, h, bs, layout)
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    blk, off = distinct_slots(h, 13, bs, seed=1)
    k, v = lay.read_tokens(kc, vc, blk, off)
    assert k.shape == v.shape == (h, 13, D) and k.dtype == dtype
    for hh, j in itertools.product(range(h), range(13)):
        rk, rv = ref_kv(kv, int(blk[hh, j]), int(off[hh, j]), hh)
        assert torch.equal(k[hh, j], rk) and torch.equal(v[hh, j], rv)
    before = k.clone()
    kv.zero_()
    assert torch.equal(k, before), "read_tokens must return copies"


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_write_tokens(dtype, h, bs, layout):
    kv = make_cache(dtype, h, bs, layout)
    expect = kv.clone()
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    blk, off = distinct_slots(h, 11, bs, seed=2)
    k, v = torch.randn(h, 11, D), torch.randn(h, 11, D)  # float32: cast on write
    lay.write_tokens(kc, vc, blk, off, k, v)
    for hh, j in itertools.product(range(h), range(11)):
        ek, ev = ref_kv(expect, int(blk[hh, j]), int(off[hh, j]), hh)
        ek.copy_(k[hh, j]), ev.copy_(v[hh, j])
    assert torch.equal(kv, expect)


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_overlapping_compaction_move(dtype, h, bs, layout):
    """The worker's move: per head keep a sorted subset of the first old_len slots
    of a block row and pack it into the first new_len slots of the same row."""
    kv = make_cache(dtype, h, bs, layout)
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    row = torch.tensor([7, 2, 5, 0])  # the request's blocks
    old_len, new_len = 3 * bs + 5, 2 * bs - 3
    slots = row[torch.arange(old_len) // bs] * bs + torch.arange(old_len) % bs
    g = torch.Generator().manual_seed(3)
    keep = torch.stack([torch.randperm(old_len, generator=g)[:new_len].sort().values
                        for _ in range(h)])
    src, dst = slots[keep], slots[:new_len].expand(h, -1)
    snapshot = kv.clone()
    k, v = lay.read_tokens(kc, vc, src // bs, src % bs)
    lay.write_tokens(kc, vc, dst // bs, dst % bs, k, v)
    for hh, j in itertools.product(range(h), range(new_len)):
        d, s = int(dst[hh, j]), int(src[hh, j])
        got, want = ref_kv(kv, d // bs, d % bs, hh), ref_kv(snapshot, s // bs, s % bs, hh)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    untouched = [b for b in range(NB) if b not in row.tolist()]
    for b in untouched:
        assert all(torch.equal(x, y) for x, y in
                   zip(ref_kv(kv, b, 0, 0), ref_kv(snapshot, b, 0, 0)))


@pytest.mark.parametrize("dtype,h,bs,layout", GRID[:4], ids=IDS[:4])
def test_write_from_a_view_of_the_cache(dtype, h, bs, layout):
    """k/v that alias the cache (here: block 3 seen as [H, BS, D]) written one
    slot further along the same block: every token must move intact."""
    kv = make_cache(dtype, h, bs, layout)
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    snapshot = kv.clone()
    k, v = kc[3].transpose(0, 1)[:, : bs - 1], vc[3].transpose(0, 1)[:, : bs - 1]
    off = torch.arange(1, bs).expand(h, -1)
    lay.write_tokens(kc, vc, torch.full_like(off, 3), off, k, v)
    for hh, o in itertools.product(range(h), range(1, bs)):
        got, want = ref_kv(kv, 3, o, hh), ref_kv(snapshot, 3, o - 1, hh)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_gathers(dtype, h, bs, layout):
    kv = make_cache(dtype, h, bs, layout)
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    bt = torch.tensor([[4, 1, 9, 0, 0], [2, 2, 6, 8, 3], [0, 5, 7, 0, 0]], dtype=torch.int32)
    nblk = 3  # fewer than the table's width
    keys, vals = lay.gather_keys(kc, bt, nblk), lay.gather_values(vc, bt, nblk)
    kt = lay.gather_keys_t(kc, bt, nblk)
    m = nblk * bs
    assert keys.shape == vals.shape == (3, h, m, D) and keys.dtype == dtype
    assert kt.shape == (3, h, D, m) and kt.dtype == torch.float32 and kt.is_contiguous()
    for b, hh, p in itertools.product(range(3), range(h), range(m)):
        rk, rv = ref_kv(kv, int(bt[b, p // bs]), p % bs, hh)
        assert torch.equal(keys[b, hh, p], rk) and torch.equal(vals[b, hh, p], rv)
        assert torch.equal(kt[b, hh, :, p], rk.float())
    assert lay.gather_keys_t(kc, bt, nblk, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_write_blocks(dtype, h, bs, layout):
    kv = make_cache(dtype, h, bs, layout)
    expect = kv.clone()
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    blocks = torch.tensor([6, 1, 8])
    k, v = torch.randn(h, 3 * bs, D), torch.randn(h, 3 * bs, D)
    lay.write_blocks(kc, vc, blocks[None], k[None], v[None])
    for hh, p in itertools.product(range(h), range(3 * bs)):
        ek, ev = ref_kv(expect, int(blocks[p // bs]), p % bs, hh)
        ek.copy_(k[hh, p]), ev.copy_(v[hh, p])
    assert torch.equal(kv, expect)
    # the inverse of one row's gather
    assert torch.equal(lay.gather_keys(kc, blocks[None], 3)[0], k.to(dtype))


@pytest.mark.parametrize("dtype,h,bs,layout", GRID, ids=IDS)
def test_fill_holes_through_nhd_layout(dtype, h, bs, layout):
    """The worker's compaction (vllm_kvevict.core.eviction.compaction.fill_holes)
    on this layout: per head, each kept token and its score land in the
    destination slot fill_holes names, [0, new_len) holds exactly the kept
    tokens, and nothing outside the row's blocks is written."""
    from vllm_kvevict.core.eviction.compaction import fill_holes

    kv = make_cache(dtype, h, bs, layout)
    lay = NHDLayout.for_cache(kv)
    kc, vc = lay.split(kv)
    scores = torch.rand(h, NB * bs)
    src, dst = torch.tensor([7, 2, 5]), torch.tensor([7, 2])
    old_len, new_len = 3 * bs - 4, 2 * bs - 5
    g = torch.Generator().manual_seed(4)
    keep = torch.stack([torch.randperm(old_len, generator=g)[:new_len] for _ in range(h)])
    snap, snap_scores = kv.clone(), scores.clone()
    after = fill_holes(lay, kc, vc, src[None], dst[None], keep[None], old_len, scores)[0]
    assert torch.equal(after.sort(dim=1).values, torch.arange(new_len).expand(h, -1))
    for hh, i in itertools.product(range(h), range(new_len)):
        j, t = int(after[hh, i]), int(keep[hh, i])
        d_slot = int(dst[j // bs]) * bs + j % bs
        s_slot = int(src[t // bs]) * bs + t % bs
        got = ref_kv(kv, d_slot // bs, d_slot % bs, hh)
        want = ref_kv(snap, s_slot // bs, s_slot % bs, hh)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert scores[hh, d_slot] == snap_scores[hh, s_slot]
    blocks = (lambda x, b: x[b]) if kv.dim() == 4 else (lambda x, b: x[:, b])
    for b in (0, 1, 3, 4, 6, 8, 9):  # blocks outside the row
        assert torch.equal(blocks(kv, b), blocks(snap, b))


class CPUTensorSpy(TorchDispatchMode):
    """Records every op that produces a CPU tensor."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
               for t in tree_flatten(out)[0]):
            self.ops.append(str(func))
        return out


def test_device_agnostic():
    """With the cache and every input on the 'meta' device (no GPU here), no
    operation may create a CPU tensor: index tensors follow the cache's device,
    which is what a CUDA cache needs."""
    with CPUTensorSpy() as spy:
        torch.arange(3)
    assert spy.ops, "the spy must see CPU allocations"
    kv = torch.empty(NB, 2, 16, 2 * D, dtype=torch.bfloat16, device="meta")
    lay = NHDLayout.for_cache(kv)
    blk = torch.zeros(2, 5, dtype=torch.long, device="meta")
    bt = torch.zeros(3, 4, dtype=torch.int32, device="meta")
    with CPUTensorSpy() as spy:
        kc, vc = lay.split(kv)
        k, v = lay.read_tokens(kc, vc, blk, blk)
        lay.write_tokens(kc, vc, blk, blk, k, v)
        lay.write_blocks(kc, vc, blk[:1, :3], k[None, :, :3].repeat(1, 1, 16, 1),
                         v[None, :, :3].repeat(1, 1, 16, 1))
        out = [lay.gather_keys(kc, bt, 3), lay.gather_values(vc, bt, 3),
               lay.gather_keys_t(kc, bt, 3)]
    assert spy.ops == []
    assert all(t.device.type == "meta" for t in (k, v, *out))


def test_both_layouts_implement_the_protocol():
    """The worker, the score path and compaction see one interface
    (core/layouts/layout.py); both caches' adapters provide all of it."""
    from vllm_kvevict.core.layouts.layout import KVCacheLayout
    from vllm_kvevict.integration.cpu_backend import discover_layout

    assert isinstance(NHDLayout(16, 2, 8, torch.float32), KVCacheLayout)
    assert isinstance(discover_layout("vec", torch.float32, 16, 64, 2), KVCacheLayout)
    assert not isinstance(object(), KVCacheLayout)
