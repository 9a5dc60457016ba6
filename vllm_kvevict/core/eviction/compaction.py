"""Compaction: bring each head's kept tokens into a request's first slots.

`fill_holes` moves only the kept tokens that lie past the new length into the
slots evicted below it: O(evicted) tokens move, and slots no longer hold tokens
in logical order. It returns where each kept token now lives, and the worker
keeps that slot order per request (`WorkerEviction.order`). It is vLLM-free and
goes through a layout adapter (`core/layouts/layout.py`: `KVLayout` for the
CPU cache, `NHDLayout` for FlashAttention's), so every backend moves tokens,
and the scores that travel with them, the same way; the per-token moves run in
the compiled CPU kernel where it is built (`kernel_dispatch.cpu_token_mover`).
There `select_and_fill_holes` also takes the policy's selection (the recent
tokens plus the top-scored older ones, `policies.base.recent_plus_top_scored`)
into the same call, held to select-then-`fill_holes` by tests/test_fill_holes.py.

On CUDA the worker runs the Triton kernel instead (triton_kernels/compaction.py:
every kept token, in order, to slots [0, new_len), in one launch without a host
sync). Both are held to one plain reference written from the definition,
`triton_kernels/reference.compact_ref` (tests/test_fill_holes.py,
tests/test_triton_kernels.py).

Rows are batched: the worker compacts one request in every layer at once when
the layers' caches are slices of one buffer (row l = layer l, blocks offset by
l * num_blocks).
"""

from __future__ import annotations

import torch

from vllm_kvevict.core.eviction.kernel_dispatch import cpu_token_mover


def hole_moves(keep: torch.Tensor, old_len: int) -> tuple[torch.Tensor, ...]:
    """The moves that fill the holes: keep (R, new_len) kept indices (distinct per
    row, any order) into old slots [0, old_len) -> (row, src, dst), each (M,)
    int64: the kept tokens at slots >= new_len go to the dropped slots < new_len,
    paired in ascending order within each row. M <= R * (old_len - new_len).

    Both lists come out of nonzero() in row-major order, and each row has as many
    holes as movers (it keeps new_len tokens), so they pair up row by row."""
    r, new_len = keep.shape
    kept = torch.zeros(r, old_len, dtype=torch.bool, device=keep.device)
    kept.scatter_(1, keep, True)
    holes = (~kept[:, :new_len]).nonzero()
    movers = kept[:, new_len:].nonzero()
    return holes[:, 0], movers[:, 1] + new_len, holes[:, 1]


def fill_holes(layout, key_cache: torch.Tensor, value_cache: torch.Tensor,
               src_blocks: torch.Tensor, dst_blocks: torch.Tensor, keep: torch.Tensor,
               old_len: int, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Keep row b's tokens `keep[b, h]` in slots [0, new_len) of `dst_blocks[b]`,
    moving only those that lie at or past new_len. Returns (B, H, new_len) int64:
    the slot (0..new_len-1) where each kept token now is.

    src_blocks: (B, n_src) blocks holding the old_len old tokens of each row
    dst_blocks: (B, n_dst) n_dst = ceil(new_len / BS); dst[b, j] == src[b, j]
                except private copies of shared blocks (copy-on-write): those
                are first copied whole from src[b, j], then holes are filled
    keep:       (B, H, new_len) int64 kept token indices into the old row
    scores:     (H, S) float32 per-slot scores to move with the tokens: the
                score of (block, offset) is column block * BS + offset (a
                stack's rows name their blocks already offset by layer)

    Everything moved is read before anything is written.
    """
    b, h, new_len = keep.shape
    bs = layout.block_size
    dev = key_cache.device
    src_blocks, dst_blocks = src_blocks.to(dev), dst_blocks.to(dev)
    keep = keep.to(dev)
    mover = cpu_token_mover(layout, key_cache)
    _copy_private_blocks(layout, key_cache, value_cache, src_blocks, dst_blocks, scores, mover)
    if mover is not None:  # the plan and one pass over the moves, in C++ (vllm_kvevict/cpu_kernel)
        *moves, now = mover.plan_hole_moves(keep.contiguous(), old_len, src_blocks.contiguous(),
                                            dst_blocks.contiguous(), bs)
        mover.move_tokens(key_cache, value_cache, *layout.element_offsets(key_cache, value_cache),
                          *moves, scores)
        return now
    (src_blk, src_off, dst_blk, dst_off, r_h), now = plan_hole_moves_torch(
        keep, old_len, src_blocks, dst_blocks, bs)
    moved = layout.read_tokens(key_cache, value_cache, src_blk, src_off, heads=r_h)
    layout.write_tokens(key_cache, value_cache, dst_blk, dst_off, *moved, heads=r_h)
    if scores is not None:
        scores[r_h, dst_blk * bs + dst_off] = scores[r_h, src_blk * bs + src_off]
    return now


def select_and_fill_holes(layout, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          src_blocks: torch.Tensor, dst_blocks: torch.Tensor,
                          token_scores: torch.Tensor, new_len: int, recent: int,
                          rows: torch.Tensor | None,
                          scores: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The policies' kept set (`policies.base.recent_plus_top_scored` of each
    row's scores) and `fill_holes` with it, in one call of the compiled CPU
    kernel (`select_hole_moves`) and one pass over the moves. In the engine
    the selection's ~15 small torch ops, the gather of its slots and the plan
    took a few hundred microseconds a compaction; here they are one call.
    Returns (kept, now), each (B, H, new_len) int64: the kept tokens' age
    indices, ascending (what the selection returns), and fill_holes' result
    for their slots; or None where that kernel does not run on this cache
    (then select, then fill_holes).

    token_scores: (B, H, old_len) float32, oldest token first
    rows:         (B, H, old_len) int64 slot of each token by age, or None
                  (slots in age order)
    the rest as fill_holes."""
    mover = cpu_token_mover(layout, key_cache)
    if mover is None:
        return None
    _copy_private_blocks(layout, key_cache, value_cache, src_blocks, dst_blocks, scores, mover)
    empty = torch.empty(0, dtype=torch.int64)
    *moves, now, kept = mover.select_hole_moves(
        token_scores.to(torch.float32).contiguous(), new_len, recent,
        empty if rows is None else rows.long().contiguous(), src_blocks.long().contiguous(),
        dst_blocks.long().contiguous(), layout.block_size)
    mover.move_tokens(key_cache, value_cache, *layout.element_offsets(key_cache, value_cache),
                      *moves, scores)
    return kept, now


def _copy_private_blocks(layout, key_cache, value_cache, src_blocks, dst_blocks, scores,
                         mover) -> None:
    """Private copies of shared blocks (dst differs from src) first: fresh
    blocks, no token's source; their holes fill after."""
    copied = (dst_blocks != src_blocks[:, : dst_blocks.shape[1]]).nonzero(as_tuple=True)
    if copied[0].numel():
        copy_blocks(key_cache, value_cache, scores, src_blocks[copied], dst_blocks[copied],
                    layout.block_size, mover)


def plan_hole_moves_torch(keep: torch.Tensor, old_len: int, src_blocks: torch.Tensor,
                          dst_blocks: torch.Tensor, bs: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`fill_holes`' plan in torch (the compiled kernel's `plan_hole_moves`
    does the same in one pass): the moves (src_blk, src_off, dst_blk, dst_off,
    head), each (M,) int64, and (B, H, new_len) the slot each kept token holds
    afterwards."""
    b, h, new_len = keep.shape
    row, src, dst = hole_moves(keep.reshape(b * h, new_len), old_len)
    r_b, r_h = row // h, row % h
    moves = [src_blocks[r_b, src // bs], src % bs, dst_blocks[r_b, dst // bs], dst % bs, r_h]
    # Where each kept token is now: its own slot, unless it lay past new_len and
    # moved into a hole. Only the movers' entries are looked up (in a map over
    # the tail only): a lookup over every kept token took half of this call.
    tail = torch.zeros(b * h, max(1, old_len - new_len), dtype=torch.int64, device=keep.device)
    tail[row, src - new_len] = dst
    keep = keep.reshape(b * h, new_len)
    at_r, at_i = (keep >= new_len).nonzero(as_tuple=True)
    now = keep.clone()
    now[at_r, at_i] = tail[at_r, keep[at_r, at_i] - new_len]
    return moves, now.view(b, h, new_len)


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, scores: torch.Tensor | None,
                src: torch.Tensor, dst: torch.Tensor, block_size: int, mover=None) -> None:
    """Copy whole blocks src[i] -> dst[i] (C,) int64, with their scores (H, S)
    if given. Raw copies along the block axis, which every layout indexes first:
    the ISA packing inside a block travels as is, nothing is unpacked. mover:
    the compiled CPU kernel (`cpu_token_mover`), or None (torch)."""
    if mover is not None:
        mover.copy_blocks(key_cache, value_cache, src, dst)
    else:
        for cache in (key_cache, value_cache):
            if cache.element_size() == 1:
                cache = cache.view(torch.uint8)  # float8 (an fp8 cache) has no index_copy_
            cache.index_copy_(0, dst, cache.index_select(0, src))
    if scores is not None:
        cols = torch.arange(block_size, device=scores.device)
        scores[:, (dst[:, None] * block_size + cols).flatten()] = \
            scores[:, (src[:, None] * block_size + cols).flatten()]


def by_age(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """(L, H, n, ...) per-slot values -> the same, oldest token first; rows:
    (L, H, n) the slot of each token by age (None: slots are in age order)."""
    if rows is None:
        return x
    idx = rows.to(x.device)
    if x.dim() == 3:
        return x.gather(2, idx)
    # (L, H, n, D): one row gather (index_select of D-element rows), not an
    # element-wise gather along n: whole rows copy as runs, not one indexed
    # element at a time. It runs for K and V at every snapkv/andpro compaction.
    l, h, n, d = x.shape
    flat = idx + n * torch.arange(l * h, device=x.device).view(l, h, 1)
    return x.reshape(-1, d).index_select(0, flat.flatten()).view(l, h, -1, d)


def slot_order(prev: torch.Tensor | None, old_len: int) -> torch.Tensor | None:
    """(L, H, old_len) int64: the slot of each resident token, oldest first,
    from `prev`, the (L, H, P) order fill_holes left at the last compaction
    (None while slots are in logical order: never compacted). Tokens written
    since then follow it in order."""
    if prev is None:
        return None
    fresh = torch.arange(prev.shape[2], old_len, device=prev.device)
    return torch.cat([prev.long(), fresh.expand(*prev.shape[:2], -1)], dim=2)
