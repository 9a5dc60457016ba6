"""Compaction by filling holes (vllm_kvevict.core.eviction.compaction.fill_holes) against the
ordered reference (`triton_kernels/reference.compact_ref`), on the CPU layout (strided and element-gather
paths) and FlashAttention's NHD layout.

fill_holes leaves slots out of logical order and says where each kept token
went; read back through that answer, every row must hold exactly what the
ordered compaction holds, while only the kept tokens past the new length moved.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import needs_stock_writer

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.eviction.compaction import (fill_holes, hole_moves, plan_hole_moves_torch,
                                                   select_and_fill_holes)
from vllm_kvevict.core.layouts.cpu_layout import split_kv_cache
from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
from vllm_kvevict.core.policies.base import recent_plus_top_scored
from vllm_kvevict.integration.cpu_backend import discover_layout
from vllm_kvevict.triton_kernels.reference import compact_ref

BS, D, H, NB = 32, 64, 2, 24


def test_hole_moves_pair_each_row_and_move_only_what_lies_past_new_len():
    keep = torch.tensor([[0, 5, 6, 2],    # holes 1, 3 <- 5, 6
                         [3, 2, 1, 0],    # nothing to move
                         [7, 6, 5, 4]])   # every slot below 4 is a hole
    row, src, dst = hole_moves(keep, old_len=8)
    assert row.tolist() == [0, 0, 2, 2, 2, 2]
    assert src.tolist() == [5, 6, 4, 5, 6, 7]
    assert dst.tolist() == [1, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("b, h, old_len, new_len, bs", [
    (1, 1, 40, 40, 16), (2, 3, 53, 35, 16), (30, 3, 192, 160, 32), (4, 2, 70, 8, 8)])
def test_compiled_plan_is_the_torch_plan(b, h, old_len, new_len, bs):
    """`plan_hole_moves` (cpu_kernel/token_moves.h) returns the moves and the
    new slots of torch's plan, move for move, on random kept sets; a row with
    a repeated or out-of-range index is refused before anything is planned."""
    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    gen = torch.Generator().manual_seed(old_len)
    keep = torch.stack([torch.randperm(old_len, generator=gen)[:new_len] for _ in range(b * h)])
    keep = keep.view(b, h, new_len)
    n_src = -(-old_len // bs)
    src = torch.randperm(b * n_src + 8, generator=gen)[: b * n_src].view(b, n_src)
    dst = src[:, : -(-new_len // bs)].clone()
    dst[0, 0] = b * n_src + 7  # a private copy of a shared block
    *moves, now = mod.plan_hole_moves(keep, old_len, src, dst, bs)
    want_moves, want_now = plan_hole_moves_torch(keep, old_len, src, dst, bs)
    assert len(moves) == len(want_moves) == 5
    for got, want in zip(moves, want_moves):
        assert torch.equal(got, want)
    assert torch.equal(now, want_now)
    if new_len < old_len:
        assert moves[0].numel() > 0  # the case moved something
    bad = keep.clone()
    bad[0, 0, 1] = bad[0, 0, 0]
    with pytest.raises(RuntimeError, match="distinct"):
        mod.plan_hole_moves(bad, old_len, src, dst, bs)
    bad[0, 0, 1] = old_len
    with pytest.raises(RuntimeError, match="distinct"):
        mod.plan_hole_moves(bad, old_len, src, dst, bs)


def _layout(name):
    """(layout, split) for a CPU layout found by probing vLLM's own KV writer
    ('vec': K stored [D][BS] per block; 'amx': tiled), its element-gather
    fallback, or FlashAttention's NHD layout."""
    if name == "nhd":
        lay = NHDLayout(BS, H, D, torch.bfloat16)
        return lay, lay.split
    isa, path = name.split("-")
    needs_stock_writer(isa)  # skips only amx on a CPU without AMX; the plugin's errors fail
    lay = discover_layout(isa, torch.bfloat16, BS, D, H)
    if path == "fallback":
        lay = dataclasses.replace(lay, k_tiles=None, v_tiles=None)
    return lay, split_kv_cache


def _random_keep(gen, rows, old_len, new_len, recent):
    """(rows, H, new_len) kept indices, unsorted, the newest `recent` always in."""
    out = []
    for _ in range(rows * H):
        old = torch.randperm(old_len - recent, generator=gen)[: new_len - recent]
        idx = torch.cat([old, torch.arange(old_len - recent, old_len)])
        out.append(idx[torch.randperm(new_len, generator=gen)])
    return torch.stack(out).view(rows, H, new_len)


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the compiled plan and moves, or torch's
@pytest.mark.parametrize("name", ["vec-strided", "vec-fallback", "amx-strided", "nhd"])
@pytest.mark.parametrize("copy_on_write", [False, True])
def test_fill_holes_holds_what_ordered_compaction_holds(name, copy_on_write, kernels, monkeypatch):
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", kernels)
    if kernels == "auto" and name != "nhd" and cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    layout, split = _layout(name)
    gen = torch.Generator().manual_seed(7)
    old_len, new_len = 3 * BS + 5, 2 * BS + 3   # 53 -> 35 tokens, 4 -> 3 blocks
    src = torch.tensor([[2, 5, 9, 11], [14, 3, 17, 20]])  # two rows (layers)
    dst = src[:, :3].clone()
    if copy_on_write:  # row 0's first block is shared: the plan gives a private one
        dst[0, 0] = 22
    kv = torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16)
    if name == "nhd":
        kv = kv.transpose(1, 2).contiguous().transpose(1, 2)  # FlashAttention's strides
    scores = torch.rand(H, NB * BS, generator=gen)
    keep = _random_keep(gen, 2, old_len, new_len, recent=8)

    ref_kv, ref_scores = kv.clone(), scores.clone()
    rk, rv = split(ref_kv)
    slots = lambda blocks, n: (blocks[:, torch.arange(n) // BS] * BS  # noqa: E731
                               + torch.arange(n) % BS)
    compact_ref(layout, rk, rv, None, slots(src, old_len), slots(dst, 3 * BS),
                keep.sort(dim=2).values)
    kc, vc = split(kv)
    before_k = layout.gather_keys(kc, src, 4).clone()
    before_v = layout.gather_values(vc, src, 4).clone()
    before_scores = scores.clone()
    untouched = [b for b in range(NB) if b not in dst.flatten().tolist()]
    after = fill_holes(layout, kc, vc, src, dst, keep, old_len, scores)

    assert after.shape == keep.shape and bool((after < new_len).all())
    assert bool((after.sort(dim=2).values == torch.arange(new_len)).all())  # a permutation
    got_k, got_v = layout.gather_keys(kc, dst, 3), layout.gather_values(vc, dst, 3)
    want_k, want_v = layout.gather_keys(rk, dst, 3), layout.gather_values(rv, dst, 3)
    # Kept token i sits at slot after[i] here, at slot rank(keep[i]) in the reference.
    rank = keep.argsort(dim=2).argsort(dim=2)
    for t, ref in ((got_k, want_k), (got_v, want_v)):
        placed = t.gather(2, after[..., None].expand(-1, -1, -1, D))
        assert torch.equal(placed, ref.gather(2, rank[..., None].expand(-1, -1, -1, D)))
    for b in range(2):  # each kept token's own bytes, read where fill_holes put it
        for h in range(H):
            for i in range(new_len):
                assert torch.equal(got_k[b, h, after[b, h, i]], before_k[b, h, keep[b, h, i]])
    # Scores moved with their tokens; only destination blocks were written.
    slot = lambda blocks, j: blocks[j // BS] * BS + j % BS  # noqa: E731
    for b in range(2):
        for h in range(H):
            for i in range(new_len):
                s_new = scores[h, slot(dst[b], int(after[b, h, i]))]
                s_old = before_scores[h, slot(src[b], int(keep[b, h, i]))]
                assert s_new == s_old
    for blk in untouched:  # the shared block of copy_on_write among them
        assert torch.equal(kv[blk], ref_kv[blk]), f"block {blk} was written"
    # O(evicted): a kept token below new_len stays in its slot; only the
    # (at most old_len - new_len per row) kept tokens past it moved.
    stays = keep < new_len
    assert torch.equal(after[stays], keep[stays])
    assert int((~stays).sum(dim=2).max()) <= old_len - new_len


@pytest.mark.parametrize("old_len, new_len, recent", [
    (3 * BS + 5, 2 * BS + 3, 8),   # drops few: the lowest are found
    (4 * BS, 2 * BS, 32),          # a prompt's compaction: drops half, the kept are found
    (3 * BS, 2 * BS, 2 * BS),      # every older token goes
    (2 * BS, 2 * BS, 16)])         # nothing goes
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("by_age", [False, True])
@pytest.mark.parametrize("copy_on_write", [False, True])
@pytest.mark.parametrize("name", ["vec-strided", "vec-fallback", "amx-strided"])
def test_compiled_selection_and_plan_equal_select_then_fill_holes(
        name, copy_on_write, by_age, ties, old_len, new_len, recent):
    """`select_and_fill_holes` (the kernel's select_hole_moves) leaves the
    cache, the moved scores and the new slots exactly as the torch selection
    (`recent_plus_top_scored`), the slots' gather and `fill_holes` do: with
    ties at the cut (SnapKV/AnDPro's chunk scores; -0.0 beside 0.0, +inf as
    finalize gives), slots out of age order after earlier compactions, and a
    private copy of a shared block."""
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    layout, split = _layout(name)
    gen = torch.Generator().manual_seed(old_len + new_len + recent)
    n_src, n_dst = -(-old_len // BS), -(-new_len // BS)
    src = torch.randperm(NB - 2, generator=gen)[: 2 * n_src].view(2, n_src)
    dst = src[:, :n_dst].clone()
    if copy_on_write:
        dst[0, 0] = NB - 1  # not among src's blocks
    kv = torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16)
    moved = torch.rand(H, NB * BS, generator=gen)
    if ties:
        values = torch.tensor([-0.0, 0.0, 1.0, 2.0, float("inf")])
        token_scores = values[torch.randint(0, 5, (2, H, old_len), generator=gen)]
    else:
        token_scores = torch.rand(2, H, old_len, generator=gen)
    rows = None
    if by_age:
        rows = torch.stack([torch.randperm(old_len, generator=gen) for _ in range(2 * H)])
        rows = rows.view(2, H, old_len)

    want_kv, want_moved = kv.clone(), moved.clone()
    keep = recent_plus_top_scored(token_scores.view(2 * H, old_len), new_len, recent)
    keep = keep.view(2, H, new_len)
    keep_slots = keep if rows is None else rows.gather(2, keep)
    want = fill_holes(layout, *split(want_kv), src, dst, keep_slots, old_len, want_moved)

    got = select_and_fill_holes(layout, *split(kv), src, dst, token_scores, new_len, recent, rows,
                                moved)
    assert got is not None
    assert torch.equal(got[0], keep) and torch.equal(got[1], want)
    assert torch.equal(kv, want_kv) and torch.equal(moved, want_moved)
    if ties and recent < new_len < old_len:  # the cut really fell among tied scores
        old = old_len - recent
        kept = torch.zeros(2, H, old_len, dtype=torch.bool).scatter_(2, keep, True)[..., :old]
        older = token_scores[..., :old]
        lowest_kept = older.masked_fill(~kept, float("inf")).amin(-1)
        highest_dropped = older.masked_fill(kept, -float("inf")).amax(-1)
        assert bool((lowest_kept == highest_dropped).any())


def test_private_scores_land_beside_their_kept_tokens():
    """After a compaction that copied the shared first blocks (dst != src), every
    kept token from the first n positions has its private score at the slot it
    now occupies; the others keep the scores that moved with them."""
    from vllm_kvevict.core.scoring.private_scores import restore

    gen = torch.Generator().manual_seed(3)
    lay, split = _layout("vec-strided")
    old_len, new_len, n = 4 * BS, 2 * BS, 2 * BS  # the first 2 blocks were shared
    src = torch.tensor([[0, 1, 2, 3]])
    dst = torch.tensor([[7, 8]])  # private copies of blocks 0 and 1
    keep = _random_keep(gen, 1, old_len, new_len, recent=8)
    scores = torch.rand(H, NB * BS, generator=gen)
    moved = scores.clone()
    kc, vc = split(torch.randn(NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16))
    after = fill_holes(lay, kc, vc, src, dst, keep, old_len, moved)
    private = torch.rand(1, H, n, generator=gen)
    restore(moved, private, keep, after, dst, BS)
    for hh in range(H):
        for j in range(new_len):
            k, a = int(keep[0, hh, j]), int(after[0, hh, j])
            column = int(dst[0, a // BS]) * BS + a % BS
            want = private[0, hh, k] if k < n else scores[hh, int(src[0, k // BS]) * BS + k % BS]
            assert moved[hh, column] == want, (hh, j, k)
