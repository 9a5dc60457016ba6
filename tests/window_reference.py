"""Plain-torch SnapKV / AnDPro reference, written from the papers with loops.

One KV head at a time, one window query at a time, the formulas as printed:

    a_i^t = softmax_{i <= t}(q_t . k_i * scale)              (AnDPro section 3.4)
    y^t   = sum_i a_i^t v_i                                   (pre-eviction output)
    snapkv: s_i = sum_{t in W} a_i^t
    andpro: s_i = sum_{t in W} a_i^t <y^t, v_i>               (theta = y, b = 0)

summed over the query heads of the KV head's group; then, over the tokens
before the window, max over the 7 neighbours (clipped at both ends of that range), sum over
chunks of 4 tokens (AnDPro's chunking, Algorithm 1 lines 2-6: a chunk's score
<y, sum_j a_j v_j> is the sum of its tokens' scores), the window and the first
token always kept, and the rest by the largest scores.

The plugin's batched path (vllm_kvevict/core/scoring/window_scores.py) is tested against it.
"""

from __future__ import annotations

import torch

POOL, CHUNK = 7, 4


def token_scores(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: (w, G, D) window queries of one KV head's group; k, v: (n, D), the
    last w of which are the window's tokens. -> (n,) float64 raw scores."""
    w, g_heads, _ = q.shape
    n = k.shape[0]
    q, k, v = q.double(), k.double(), v.double()
    s = torch.zeros(n, dtype=torch.float64)
    for g in range(g_heads):
        for t in range(w):
            seen = n - w + t + 1  # the window's t-th token sees itself and all before
            a = torch.softmax(k[:seen] @ q[t, g] * scale, dim=0)
            if kind == "snapkv":
                s[:seen] += a
            else:
                y = a @ v[:seen]
                s[:seen] += a * (v[:seen] @ y)  # a_i <y, v_i> for every i at once
    return s


def selection_scores(raw: torch.Tensor, window: int) -> torch.Tensor:
    """(n,) raw -> (n,) with the older tokens pooled and chunked, window and
    first token +inf."""
    n = raw.shape[0]
    m = n - window
    out = torch.full((n,), float("inf"), dtype=torch.float64)
    # Neighbours before the window only (as SnapKV pools the prefix's scores).
    pooled = [max(raw[max(0, i - POOL // 2): min(m, i + POOL // 2 + 1)].tolist())
              for i in range(m)]
    for c0 in range(0, m, CHUNK):
        total = sum(pooled[c0:c0 + CHUNK])
        for i in range(c0, min(c0 + CHUNK, m)):
            out[i] = total
    if m > 0:
        out[0] = float("inf")
    return out


def keep(scores: torch.Tensor, budget: int, recent: int) -> list[int]:
    """Kept indices (ascending): the `recent` newest, plus the best older ones."""
    n = scores.shape[0]
    older = sorted(range(n - recent), key=lambda i: -float(scores[i]))[: budget - recent]
    return sorted(older) + list(range(n - recent, n))
