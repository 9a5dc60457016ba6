"""Launcher: paged decode attention that emits H2O scores (`jit/paged_attention.py`).

    out, scores += paged_attention_scores(query, key_cache, value_cache, ...)

Reads the FlashAttention cache layout of vLLM 0.32 (`NHDLayout.split` views,
``[NB, BS, H, D]`` with any block/token/head strides). Torch reference:
`reference.paged_attention_scores_ref`.
"""
from __future__ import annotations

import torch
import triton

from ._checks import (expect, float_tensor, float_vector, index_tensor, pow2_at_least_16,
                      same_device)
from .jit.paged_attention import paged_attention_scores_kernel

# Scratch logits of one launch, (T, H, G, L) float32: bounded to 128 MB by
# launching the queries in tiles.
_SCRATCH_ELEMENTS = 1 << 25
# Keys per step of each program's walk: 128 rather than one 16-token block
# took fewer, larger loads per program and ran faster on the H100 for both
# MHA and GQA (results/gpu/2026-11-26-h100.md has the times). Costs a few
# register spills at D >= 96 (tests/test_triton_aot.py).
KEYS_PER_STEP = 128
# Head sizes over 128 keep the one-block step of before (16 keys): with a
# 256-wide K and V tile, 128 keys spilled over 1 KB of registers and 64 keys
# 5 KB on sm_80 (ptxas, tests/test_triton_aot.py -m slow); 16 spill nothing,
# and no GPU has timed D = 256 yet.


def keys_per_step_for(head_size: int) -> int:
    return KEYS_PER_STEP if head_size <= 128 else 16


def paged_attention_scores(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_table: torch.Tensor,
                           query_rows: torch.Tensor, visible: torch.Tensor, scale: float,
                           scores: torch.Tensor | None = None,
                           score_weight: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, write_out: bool = True,
                           max_visible: int | None = None,
                           unique_rows: bool = False,
                           keys_per_step: int | None = None) -> torch.Tensor | None:
    """Attention of T single-token queries over their requests' paged keys.

    query:        (T, H_q, D)
    key_cache:    (NB, BS, H, D) (value_cache the same), unit stride on D
    block_table:  (R, max_blocks) int, row r lists request r's blocks in order
    query_rows:   (T,) int, the block-table row of each query
    visible:      (T,) int, query t sees physical positions [0, visible[t]);
                  0 = an empty request (output 0, adds nothing)
    scores:       (H, NB * BS) float32, += sum over the G query heads of each
                  KV head of softmax(q k^T * scale), at each key's slot
                  (block * BS + offset); None = attention only
    score_weight: (T,) float32 multiplier per query (0 = unscored); None = 1
    out:          (T, H_q, D) written when write_out (allocated if None)
    max_visible:  max(visible) when the caller knows it (saves a device sync)
    unique_rows:  the caller promises no two queries' rows share a block
                  (decode, one query per request, shared blocks scored in
                  private rows elsewhere), so no two programs add to one slot
                  and the score adds need no atomics
    keys_per_step: keys each program takes per step of its walk (a power of
                  two >= 16, across block boundaries); None: keys_per_step_for(D)
    returns out (or None when write_out is False)
    """
    float_tensor("query", query, 3)
    float_tensor("key_cache", key_cache, 4)
    float_tensor("value_cache", value_cache, 4)
    t, hq, d = query.shape
    nb, bs, h, dk = key_cache.shape
    expect(value_cache.shape == key_cache.shape,
           f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    expect(dk == d, f"head size: query {d}, cache {dk}")
    expect(hq % h == 0, f"{hq} query heads are not a multiple of {h} KV heads")
    expect(query.dtype == key_cache.dtype == value_cache.dtype,
           f"dtypes differ: query {query.dtype}, K {key_cache.dtype}, V {value_cache.dtype}")
    pow2_at_least_16("block size", bs)
    keys = keys_per_step_for(query.shape[-1]) if keys_per_step is None else keys_per_step
    pow2_at_least_16("keys_per_step", keys)
    expect(scores is not None or write_out, "nothing to compute: no scores and write_out=False")
    same_device(query, key_cache, value_cache)
    dev = query.device
    expect(block_table.dim() == 2, f"block_table: expected 2 dims, got {tuple(block_table.shape)}")
    block_table = index_tensor("block_table", block_table, block_table.shape, dev).to(torch.int32)
    query_rows = index_tensor("query_rows", query_rows, (t,), dev).to(torch.int32)
    visible = index_tensor("visible", visible, (t,), dev).to(torch.int32)
    if scores is not None:
        expect(scores.dtype == torch.float32 and scores.stride(1) == 1
               and tuple(scores.shape) == (h, nb * bs),
               f"scores: expected float32 ({h}, {nb * bs}) with unit column stride, "
               f"got {scores.dtype} {tuple(scores.shape)} strides {scores.stride()}")
    if write_out:
        out = torch.empty_like(query) if out is None else out
        expect(tuple(out.shape) == (t, hq, d) and out.stride(-1) == 1,
               f"out: expected ({t}, {hq}, {d}) with unit last stride, got {tuple(out.shape)}")
    w = (torch.ones(t, device=dev, dtype=torch.float32) if score_weight is None
         else float_vector("score_weight", score_weight, t, dev))
    if t == 0:
        return out if write_out else None
    g = hq // h
    g_pad, d_pad = max(16, triton.next_power_of_2(g)), max(16, triton.next_power_of_2(d))
    n_max = int(visible.max()) if max_visible is None else max_visible
    expect(n_max <= block_table.shape[1] * bs,
           f"a query sees {n_max} keys but block-table rows hold {block_table.shape[1] * bs}")
    length = max(bs, triton.cdiv(n_max, bs) * bs)
    tile = max(1, _SCRATCH_ELEMENTS // (h * g * length)) if scores is not None else t
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    for t0 in range(0, t, tile):
        sl = slice(t0, t0 + tile)
        q = query[sl]
        o = out[sl] if write_out else q
        sc = scores if scores is not None else dummy
        scratch = (torch.empty(q.shape[0], h, g, length, device=dev, dtype=torch.float32)
                   if scores is not None else dummy.view(1, 1, 1, 1))
        paged_attention_scores_kernel[(q.shape[0], h)](
            q, key_cache, value_cache, block_table, query_rows[sl], visible[sl], w[sl],
            o, sc, scratch, scale,
            q.stride(0), q.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table.stride(0),
            o.stride(0), o.stride(1),
            sc.stride(0) if scores is not None else 0,
            scratch.stride(0), scratch.stride(1), scratch.stride(2),
            G=g, D=d, BS=bs, G_PAD=g_pad, D_PAD=d_pad,
            WRITE_OUT=write_out, SCORE=scores is not None, ATOMIC=not unique_rows, TILE=keys,
        )
    return out if write_out else None

