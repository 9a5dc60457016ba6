"""Launcher: InfiniGen's speculative partial attention (`jit/partial_attention.py`)
and the selection it drives. Reference: `reference.partial_attention_ref`."""
from __future__ import annotations

import math

import torch
import triton

from ._checks import expect, float_tensor, index_tensor, same_device
from .jit.partial_attention import partial_attention_kernel

BLOCK_N = 64


def partial_attention(q: torch.Tensor, k: torch.Tensor, cols: torch.Tensor,
                      lengths: torch.Tensor, alpha: float, scale: float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial logits over the channels `cols`, and the count above max - alpha.

    q:       (B, H_q, Dq) (skewed) queries
    k:       (B, H, N, Dk) (skewed) keys, or an already partial key cache
    cols:    (C,) int channel indices into both q and k (C <= min(Dq, Dk))
    lengths: (B,) int, row b has tokens [0, lengths[b])
    returns  logits (B, H_q, N) float32, -inf past each length;
             counts (B, H_q) int32, tokens with logit > max - alpha
    """
    float_tensor("q", q, 3)
    float_tensor("k", k, 4)
    same_device(q, k)
    b, hq, _ = q.shape
    h, n = k.shape[1], k.shape[2]
    expect(k.shape[0] == b, f"k has {k.shape[0]} rows, q {b}")
    expect(hq % h == 0, f"{hq} query heads are not a multiple of {h} KV heads")
    expect(cols.dim() == 1 and cols.numel() >= 1, "cols must be a non-empty (C,) index vector")
    c = cols.numel()
    cols = index_tensor("cols", cols, (c,), q.device).to(torch.int32)
    lengths = index_tensor("lengths", lengths, (b,), q.device).to(torch.int32)
    logits = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
    counts = torch.zeros(b, hq, dtype=torch.int32, device=q.device)
    if b == 0 or n == 0:
        return logits, counts
    partial_attention_kernel[(b, hq)](
        q, k, cols, lengths, logits, counts, scale, alpha, c,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        logits.stride(0), logits.stride(1),
        G=hq // h, C_PAD=max(2, triton.next_power_of_2(c)), BLOCK_N=BLOCK_N,
    )
    return logits, counts


def speculated_tokens(logits: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor,
                      max_fraction: float = 1.0) -> list[torch.Tensor]:
    """The tokens to prefetch, the same number for every head of a row (the
    mean of the heads' counts, as InfiniGen does), at most max_fraction of the
    row's tokens and at least one when the row has any.

    logits (B, H_q, N), counts (B, H_q), lengths (B,) -> per row b a
    (H_q, k_b) int64 tensor of token indices, highest partial logit first.
    """
    out = []
    for row, cnt, n in zip(logits, counts.float().mean(dim=1).tolist(), lengths.tolist()):
        n = int(n)
        k = min(math.ceil(cnt), math.ceil(max_fraction * n), n)
        k = max(k, 1) if n else 0
        out.append(row[:, :n].topk(k, dim=1).indices)
    return out
