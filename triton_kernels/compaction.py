"""Launcher: in-place compaction of the NHD paged cache (`jit/compaction.py`).

Every kept token of each (row, KV head), with its score, moves in order to
the row's first slots, in one kernel, without an intermediate gathered copy
and without a host sync (the CPU path, `core/eviction/compaction.fill_holes`,
moves only the tokens past the new length, but finds them with `nonzero`).
Reference: `reference.compact_ref`.
"""
from __future__ import annotations

import torch
import triton

from ._checks import expect, float_tensor, in_place_safe, index_tensor, same_device
from .jit.compaction import compact_kernel

BLOCK_T = 32  # destination tokens per tile
BLOCK_D = 32  # channels per program


def compact_in_place(key_cache: torch.Tensor, value_cache: torch.Tensor,
                     scores: torch.Tensor | None, src_slots: torch.Tensor,
                     dst_slots: torch.Tensor, keep: torch.Tensor) -> None:
    """Per row r and KV head h, token keep[r, h, j] of the row's old tokens
    moves to dst_slots[r, j]; dst slots past new_len are zeroed.

    key_cache:  (NB, BS, H, D) (value_cache the same), unit stride on D
    scores:     (H, NB * BS) float32 moved along with the tokens, or None
    src_slots:  (R, old_len) int, slot (block * BS + offset) of each old token
    dst_slots:  (R, n_dst * BS) int, the slots of the row's destination blocks
    keep:       (R, H, new_len) int, ascending indices into the old tokens,
                new_len <= n_dst * BS

    In place: dst slot j must be src slot j or a slot no source uses (vLLM's
    plans: the row keeps its first blocks, or a private copy of a shared one).
    A plan that breaks this is refused (ValueError), checked per row with one
    torch.isin on the slots as given: the worker passes CPU index tensors, so
    the check's one host read (.any()) syncs with no device; device tensors
    pay one sync.
    """
    float_tensor("key_cache", key_cache, 4)
    float_tensor("value_cache", value_cache, 4)
    expect(value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype,
           "value_cache must match key_cache in shape and dtype")
    nb, bs, h, d = key_cache.shape
    dev = key_cache.device
    expect(src_slots.dim() == 2 and dst_slots.dim() == 2 and keep.dim() == 3,
           "src_slots (R, old_len), dst_slots (R, n_dst*BS), keep (R, H, new_len)")
    r, new_len = keep.shape[0], keep.shape[2]
    expect(keep.shape[1] == h, f"keep has {keep.shape[1]} heads, the cache {h}")
    n_dst = dst_slots.shape[1]
    expect(n_dst % bs == 0 and new_len <= n_dst,
           f"dst_slots must cover whole blocks holding new_len={new_len}, got {n_dst}")
    src_in, dst_in = src_slots, dst_slots
    src_slots = index_tensor("src_slots", src_slots, (r, src_slots.shape[1]), dev)
    dst_slots = index_tensor("dst_slots", dst_slots, (r, n_dst), dev)
    in_place_safe(src_in, dst_in)  # where the caller built them (the worker: CPU)
    keep = index_tensor("keep", keep, (r, h, new_len), dev)
    if scores is not None:
        same_device(key_cache, scores)
        expect(scores.dtype == torch.float32 and scores.stride(1) == 1
               and tuple(scores.shape) == (h, nb * bs),
               f"scores: expected float32 ({h}, {nb * bs}) with unit column stride")
    if r == 0 or n_dst == 0:
        return
    sc = scores if scores is not None else key_cache.new_empty(1, 1, dtype=torch.float32)
    grid = (r, h, triton.cdiv(d, BLOCK_D))
    compact_kernel[grid](
        key_cache, value_cache, sc, src_slots, dst_slots, keep, new_len, n_dst,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        sc.stride(0), src_slots.stride(0), dst_slots.stride(0), keep.stride(0), keep.stride(1),
        D=d, BS=bs, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, SCORES=scores is not None,
    )
