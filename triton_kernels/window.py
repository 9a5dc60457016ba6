"""Launcher: SnapKV / AnDPro window scores (`jit/window.py`).

Same contract as the torch path `vllm_kvevict.core.scoring.window_scores.raw_scores_torch`,
which is this kernel's reference.
"""
from __future__ import annotations

import torch
import triton

from ._checks import expect, float_tensor, same_device
from .jit.window import window_scores_kernel

ROWS = 32  # window rows (query head x window query) per program
BLOCK_N = 64  # resident tokens per tile


def window_raw_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, projection: bool = False) -> torch.Tensor:
    """(B, W, H_q, D), (B, H, N, D) x2 -> (B, H, N) float32 raw window scores
    (before pooling): the window's attention a[t, i] summed over the query
    heads and queries (SnapKV); with `projection`, a[t, i] * <y_t, v_i> summed
    (AnDPro; v is read only then). Query t sits at token N - W + t and sees
    tokens <= it."""
    expect(isinstance(projection, bool), f"projection must be a bool, got {projection!r}")
    float_tensor("q", q, 4)
    float_tensor("k", k, 4)
    float_tensor("v", v, 4)
    same_device(q, k, v)
    b, w, hq, d = q.shape
    expect(k.shape == v.shape and k.shape[0] == b and k.shape[3] == d,
           f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    h, n = k.shape[1], k.shape[2]
    expect(hq % h == 0, f"{hq} query heads are not a multiple of {h} KV heads")
    expect(1 <= w <= n, f"window {w} must be within 1..{n} resident tokens")
    expect(q.dtype == k.dtype == v.dtype, f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    out = torch.zeros(b, h, n, dtype=torch.float32, device=q.device)
    g = hq // h
    grid = (b, h, triton.cdiv(g * w, ROWS))
    window_scores_kernel[grid](
        q, k, v, out, scale, n, w,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1),
        G=g, D=d, D_PAD=max(16, triton.next_power_of_2(d)), ROWS=ROWS, BLOCK_N=BLOCK_N,
        PROJECTION=projection,
    )
    return out
