"""The host tier and InfiniGen's decode attention (core/offload/host_tier.py, core/offload/decode_attention.py)
against the one-row dense reference written from the paper."""
import math

import pytest
import torch

from vllm_kvevict.core.offload.host_tier import HostTier
from vllm_kvevict.core.offload.decode_attention import (
    Fetched,
    decode_attention,
    infinigen_decode_reference,
    partial_logits,
    select_host_entries,
    speculate,
)
from vllm_kvevict.core.offload.skewing import Skewing, skew_keys, skew_matrix, skew_queries

H, G, D, BS, C = 3, 3, 16, 4, 5
HQ = H * G
SCALE = D ** -0.5


def _skewing(num_layers: int, gen) -> torch.Tensor:
    q = torch.randn(num_layers, H, 64, D, generator=gen) * torch.linspace(3, 0.1, D)
    a = torch.stack([torch.stack([skew_matrix(q[l, h]) for h in range(H)])
                     for l in range(num_layers)])
    return Skewing(a, torch.arange(C).expand(num_layers, H, C).clone()).a


def _row(gen, n: int, resident: int):
    """A dense row and its split: per head a random resident set of equal size."""
    k = torch.randn(H, n, D, generator=gen)
    v = torch.randn(H, n, D, generator=gen)
    q = torch.randn(HQ, D, generator=gen) * 2
    order = torch.stack([torch.randperm(n, generator=gen) for _ in range(H)])  # (H, n)
    res_idx, host_idx = order[:, :resident], order[:, resident:]
    mask = torch.zeros(H, n, dtype=torch.bool)
    mask.scatter_(1, res_idx, True)
    return q, k, v, mask, res_idx, host_idx


def _gather(x, idx):  # x (H, n, D), idx (H, m) -> (H, m, D)
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


@pytest.mark.parametrize("alpha,cap", [(4.0, 1000), (1.0, 1000), (4.0, 6), (1e9, 1000)])
def test_batched_path_equals_paper_reference(alpha, cap):
    gen = torch.Generator().manual_seed(0)
    a = _skewing(1, gen)[0]
    rows = [_row(gen, n, res) for n, res in ((40, 12), (29, 12), (17, 8))]
    tier = HostTier(capacity=1000, victim="counter", a=a[None], num_partial=C, block_size=BS,
                    dtype=torch.float32)
    r = len(rows)
    s = max(x[4].shape[1] for x in rows)
    k_res = torch.zeros(r, H, s, D)
    v_res = torch.zeros(r, H, s, D)
    res_len = torch.tensor([x[4].shape[1] for x in rows])
    for i, (q, k, v, mask, res_idx, host_idx) in enumerate(rows):
        m = res_idx.shape[1]
        k_res[i, :, :m], v_res[i, :, :m] = _gather(k, res_idx), _gather(v, res_idx)
        # offload the host entries in two compactions, as decode would
        half = host_idx.shape[1] // 2
        for part in (host_idx[:, :half], host_idx[:, half:]):
            tier.offload(f"r{i}", _gather(k, part)[None], _gather(v, part)[None])
    ids = [f"r{i}" for i in range(r)]
    q = torch.stack([x[0] for x in rows])
    out = decode_attention(tier, ids, 0, q, k_res, v_res, res_len, alpha,
                           torch.full((r,), cap), SCALE)
    for i, (qi, k, v, mask, _, _) in enumerate(rows):
        ref = infinigen_decode_reference(qi, k, v, mask, a, C, alpha, cap, SCALE)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
        if alpha >= 1e9:  # every host entry came back: full attention
            full = torch.stack([((k[j // G] @ qi[j]) * SCALE).softmax(0) @ v[j // G]
                                for j in range(HQ)])
            torch.testing.assert_close(out[i], full, atol=1e-5, rtol=1e-5)
    assert tier.stats.entries_missed == 0
    if cap < 1000:  # the cap binds: some host entries stay on the host
        assert tier.stats.entries_fetched < sum(x[5].numel() for x in rows)


def _tier_and_rows(seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = _skewing(1, gen)[0]
    rows = [_row(gen, n, res) for n, res in ((40, 12), (29, 12))]
    tier = HostTier(capacity=1000, victim="counter", a=a[None], num_partial=C, block_size=BS,
                    dtype=torch.float32)
    s = max(x[4].shape[1] for x in rows)
    k_res, v_res = torch.zeros(2, H, s, D), torch.zeros(2, H, s, D)
    for i, (q, k, v, mask, res_idx, host_idx) in enumerate(rows):
        m = res_idx.shape[1]
        k_res[i, :, :m], v_res[i, :, :m] = _gather(k, res_idx), _gather(v, res_idx)
        tier.offload(f"r{i}", _gather(k, host_idx)[None], _gather(v, host_idx)[None])
    res_len = torch.tensor([x[4].shape[1] for x in rows])
    q = torch.stack([x[0] for x in rows])
    return tier, q, k_res, v_res, res_len


@pytest.mark.parametrize("quality", ["own query", "noisy", "unrelated", "nothing"])
def test_prefetched_entries_change_traffic_not_output(quality):
    """Speculation with a predicted query (good, noisy or unrelated) decides
    what is fetched ahead; the layer's own query decides what is attended, so
    the output equals the no-prefetch path, and hits are counted exactly."""
    tier, q, k_res, v_res, res_len = _tier_and_rows(2)
    ids, cap = ["r0", "r1"], torch.tensor([12, 10])
    want = decode_attention(tier, ids, 0, q, k_res, v_res, res_len, 4.0, cap, SCALE)
    gen = torch.Generator().manual_seed(3)
    q_pred = {"own query": q, "noisy": q + 0.5 * torch.randn(q.shape, generator=gen),
              "unrelated": torch.randn(q.shape, generator=gen) * 2, "nothing": q}[quality]
    pre = speculate(tier, ids, 0, q_pred, k_res, res_len, 4.0, cap, SCALE)
    if quality == "nothing":  # a prefetch that brought nothing back
        pre = Fetched(torch.full_like(pre.sel, -1), pre.k, pre.v, torch.zeros_like(pre.mask))
    hits_before = tier.stats.speculation_hits
    got = decode_attention(tier, ids, 0, q, k_res, v_res, res_len, 4.0, cap, SCALE,
                           prefetched=pre)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    hits = tier.stats.speculation_hits - hits_before
    needed = tier.stats.prefetch_needed
    # Hits counted by hand: needed (row, query head, entry) that pre holds.
    from vllm_kvevict.core.offload.decode_attention import select_entries
    sel = select_entries(tier, ids, 0, q, k_res, res_len, 4.0, cap, SCALE)
    expect = sum(int(e) in set(pre.sel[r, h][pre.mask[r, h]].tolist())
                 for r in range(2) for h in range(HQ) for e in sel[r, h] if e >= 0)
    assert hits == expect and needed == int((sel >= 0).sum())
    if quality == "own query":
        assert hits == needed > 0
    if quality == "nothing":
        assert hits == 0


def test_small_alpha_fetches_less_than_large():
    gen = torch.Generator().manual_seed(1)
    a = _skewing(1, gen)[0]
    q, k, v, mask, res_idx, host_idx = _row(gen, 64, 16)
    counts = []
    for alpha in (0.5, 2.0, 8.0, 1e9):
        qp = skew_queries(q[None, :, None, :], a)[:, :, 0, :C]
        sel = select_host_entries(
            partial_logits(qp, skew_keys(_gather(k, res_idx), a)[None, ..., :C], SCALE),
            partial_logits(qp, skew_keys(_gather(k, host_idx), a)[None, ..., :C], SCALE),
            torch.tensor([1000]), alpha)
        counts.append(int((sel >= 0).sum()))
    assert counts == sorted(counts) and counts[0] < counts[-1] == HQ * 48


def test_dropped_blocks_are_misses_and_free_empties_the_pool():
    gen = torch.Generator().manual_seed(2)
    a = _skewing(2, gen)
    tier = HostTier(capacity=4, victim="fifo", a=a, num_partial=C, block_size=BS,
                    dtype=torch.float32)
    k = torch.randn(2, H, 3 * BS, D, generator=gen)  # 3 blocks per layer: 6 > 4
    tier.offload("x", k, k.clone())
    assert len(tier.pool) == 4 and tier.pool.stats.evictions == 2
    sel = torch.arange(3 * BS).expand(1, HQ, -1)  # every entry of layer 0
    _, _, mask = tier.fetch(["x"], 0, sel, G)
    assert not mask[0, :, :2 * BS].any() and mask[0, :, 2 * BS:].all()  # fifo dropped 0, 1
    assert tier.stats.entries_missed == H * 2 * BS == tier.stats.entries_dropped
    tier.offload("y", k[:, :, :BS], k[:, :, :BS])
    assert tier.free("x") + tier.free("y") == 4 and len(tier.pool) == 0
    assert "x" not in tier and tier.num_entries("y") == 0


def test_partial_block_padding_is_never_selected():
    gen = torch.Generator().manual_seed(3)
    a = _skewing(1, gen)
    tier = HostTier(capacity=10, victim="lru", a=a, num_partial=C, block_size=BS,
                    dtype=torch.float32)
    tier.offload("x", torch.randn(1, H, BS + 1, D, generator=gen),
                 torch.randn(1, H, BS + 1, D, generator=gen))  # 2 blocks, 1 + 3 pad
    kp, valid = tier.partial_keys(["x"], 0)
    assert valid.sum() == BS + 1 and kp.shape[2] == 2 * BS
    lh = partial_logits(torch.randn(1, HQ, C, generator=gen), kp, 1.0)
    sel = select_host_entries(torch.zeros(1, HQ, 1), lh.masked_fill(~valid[:, None], -math.inf),
                              torch.tensor([99]), math.inf)
    assert int(sel.max()) == BS and (sel >= 0).sum() == HQ * (BS + 1)


@pytest.mark.parametrize("swap,dtype", [(1 << 20, torch.float32), (3 << 20, torch.bfloat16),
                                        (777_777, torch.float16)])
def test_pool_and_partial_keys_fit_the_swap_space(swap, dtype):
    """K/V slab + partial-key slab <= --kv-swap-space, and one more slot per
    layer would not fit (the budget is used, not just respected)."""
    num_layers, bs, d, c = 2, 32, 64, 19
    a = torch.eye(d).expand(num_layers, H, d, d)
    cap = HostTier.capacity_for(swap, num_layers, H, bs, d, c, dtype)
    tier = HostTier(cap, "counter", a, c, bs, dtype)
    slab = tier.pool.slab.numel() * tier.pool.slab.element_size()
    assert tier.pool.capacity == cap and cap % num_layers == 0
    assert slab + tier.kp.numel() * 4 == tier.nbytes <= swap
    assert tier.nbytes * (cap + num_layers) // cap > swap


def test_the_worker_sizes_its_tier_by_the_swap_space(tmp_path):
    """integration/offload_attention.host_tier: the tier it makes, partial keys
    included, fits --kv-swap-space (16 MiB, SmolLM2's layout, one rank)."""
    from types import SimpleNamespace

    from vllm_kvevict.core.config.settings import EvictionConfig
    from vllm_kvevict.integration.offload_attention import OffloadState, host_tier

    path = tmp_path / "skew.safetensors"
    Skewing.identity(30, 3, 64).save(path)
    cfg = EvictionConfig.from_dict({"kv_eviction": "infinigen", "kv_swap_space": "16MiB",
                                    "kv_skewing": str(path)})
    state = SimpleNamespace(cfg=cfg, offload=OffloadState("unused"))
    layout = SimpleNamespace(num_kv_heads=3, block_size=32, head_size=64)
    tier = host_tier(state, layout, torch.float32)
    assert tier.c == 19 and 0.8 * cfg.swap_bytes < tier.nbytes <= cfg.swap_bytes == 16 << 20


def test_offloads_append_partial_keys_and_leave_earlier_ones_alone():
    """Two offloads (the first ends in a padded block): every layer's partial
    keys are skew_keys of the entries offloaded, in order, padding invalid."""
    gen = torch.Generator().manual_seed(4)
    a = _skewing(2, gen)
    tier = HostTier(capacity=100, victim="counter", a=a, num_partial=C, block_size=BS,
                    dtype=torch.float32)
    k1 = torch.randn(2, H, BS + 2, D, generator=gen)
    k2 = torch.randn(2, H, 2 * BS, D, generator=gen)
    tier.offload("x", k1, k1)
    before = [tier.partial_keys(["x"], layer)[0].clone() for layer in range(2)]
    tier.offload("y", k2[:, :, :3], k2[:, :, :3])  # another request between them
    tier.offload("x", k2, k2)
    for layer in range(2):
        kp, valid = tier.partial_keys(["x", "y"], layer)
        assert kp.shape == (2, H, 4 * BS, C)
        want = skew_keys(torch.cat([k1[layer], k2[layer]], dim=1), a[layer])[..., :C]
        got = kp[0][:, valid[0]]  # (H, E1 + E2, C): the padding dropped
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(kp[0, :, :2 * BS], before[layer][0])
        assert valid[0].tolist() == [True] * (BS + 2) + [False] * (BS - 2) + [True] * 2 * BS
        assert valid[1].sum() == 3 and tier.num_entries("x") == 3 * BS + 2
        torch.testing.assert_close(kp[1][:, valid[1]], skew_keys(k2[layer, :, :3],
                                                                 a[layer])[..., :C])


@pytest.mark.parametrize("alpha,cap", [(4.0, 1000), (1.0, 1000), (4.0, 6), (1e9, 1000)])
def test_dropped_block_leaves_with_its_partial_keys(alpha, cap):
    """FIFO drops the first host block: its entries are invalid in
    partial_keys, so decode equals the paper's reference on a cache without
    those tokens (they are gone, not selected-and-missed); each fetch counts
    them in entries_missed, entries_dropped once; the slot's new block has
    its own partial keys."""
    gen = torch.Generator().manual_seed(5)
    a = _skewing(1, gen)[0]
    q, k, v, mask, res_idx, host_idx = _row(gen, 40, 12)  # 28 host entries: 7 blocks
    tier = HostTier(capacity=6, victim="fifo", a=a[None], num_partial=C, block_size=BS,
                    dtype=torch.float32)
    for part in (host_idx[:, :2 * BS], host_idx[:, 2 * BS:]):
        tier.offload("x", _gather(k, part)[None], _gather(v, part)[None])
    assert tier.pool.stats.evictions == 1 and ("x", 0, 0) not in tier.pool
    assert tier.stats.entries_dropped == H * BS
    kp, valid = tier.partial_keys(["x"], 0)
    assert valid[0].tolist() == [False] * BS + [True] * 6 * BS
    torch.testing.assert_close(kp[0, :, BS:], skew_keys(_gather(k, host_idx[:, BS:]), a)[..., :C])
    assert kp[0, :, :BS].eq(0).all()

    k_res, v_res = _gather(k, res_idx)[None], _gather(v, res_idx)[None]
    missed = tier.stats.entries_missed
    out = decode_attention(tier, ["x"], 0, q[None], k_res, v_res, torch.tensor([12]), alpha,
                           torch.tensor([cap]), SCALE)
    assert tier.stats.entries_missed - missed == H * BS  # one fetch
    gone = torch.zeros(H, 40, dtype=torch.bool)
    gone.scatter_(1, host_idx[:, :BS], True)
    left = (~gone).nonzero()[:, 1].view(H, -1)  # (H, 36) tokens still somewhere
    ref = infinigen_decode_reference(q, _gather(k, left), _gather(v, left), mask.gather(1, left),
                                     a, C, alpha, cap, SCALE)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
