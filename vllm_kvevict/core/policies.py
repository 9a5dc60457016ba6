"""Eviction policies: given per-head scores over resident tokens, pick what stays.

A policy sees one layer of one request at a time:

    scores: (num_kv_heads, n)   float, importance of the j-th oldest resident token
    returns (num_kv_heads, keep) int64, kept indices j, ascending per head

The worker hands each head's tokens oldest first (after a compaction that
filled holes, through the request's slot order), so "the last r" are the r most
recent tokens and "the first s" the oldest; the indices returned are positions
in that order. Every head keeps the same count, which is what lets the stock paged
attention kernels read the compacted cache unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from vllm_kvevict.core.config import WINDOW_POLICIES


class EvictionPolicy(ABC):
    needs_scores: bool = True  # accumulates attention into the per-slot score buffer
    window: int = 0  # > 0: scores come from the last `window` queries at compaction

    @abstractmethod
    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        """(H, n) scores -> (H, keep) ascending kept slot indices."""


class H2OPolicy(EvictionPolicy):
    """Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048, Algorithm 1).

    Keeps the `recent` newest tokens plus the `keep - recent` older tokens with
    the largest accumulated attention (summed over the query heads of each KV
    head's GQA group). Evicting in one batch of many tokens equals running the
    paper's one-at-a-time greedy step repeatedly with frozen scores.
    """

    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        num_heads, n = scores.shape
        assert 0 <= recent <= keep <= n, (recent, keep, n)
        tail = torch.arange(n - recent, n, device=scores.device).expand(num_heads, -1)
        heavy = torch.topk(scores[:, : n - recent], keep - recent, dim=1).indices
        return torch.cat([heavy, tail], dim=1).sort(dim=1).values


class StreamingPolicy(EvictionPolicy):
    """StreamingLLM (Xiao et al. 2023): the first `sink` tokens + the newest ones."""

    needs_scores = False

    def __init__(self, sink: int) -> None:
        self.sink = sink

    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        num_heads, n = scores.shape
        sink = min(self.sink, keep)
        idx = torch.cat([torch.arange(sink), torch.arange(n - (keep - sink), n)])
        return idx.to(scores.device).expand(num_heads, -1).contiguous()


class WindowPolicy(H2OPolicy):
    """SnapKV (Li et al. 2024) and AnDPro (anchor direction projection): at each
    compaction, the last `window` queries score every resident token
    (`vllm_kvevict.core.window_scores`), and the kept set is the recent tokens (the
    window itself, unless the budget is under two windows: then half the
    budget) plus the best-scored older ones, as H2O selects.

    The paper compresses the prompt once; here the same rule runs at every
    compaction: between prompt chunks and, during decode, once per block of new
    tokens, with the latest `window` tokens (prompt or generated) as the window.
    Every KV head keeps the same count: the paper's cross-head budget
    allocation (Ada-KV style) needs a per-head length the stock kernels lack.
    """

    needs_scores = False

    def __init__(self, kind: str, window: int) -> None:
        self.kind = kind
        self.window = window

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, recent: int | None = None) -> torch.Tensor:
        """(B, w, H_q, D), (B, H, n, D) x2 -> (B, H, n) selection scores; the
        `recent` newest tokens (default: the window) are the ones always kept."""
        from vllm_kvevict.core.window_scores import window_scores

        return window_scores(self.kind, q, k, v, scale, recent)


def make_policy(name: str, sink: int = 4, window: int = 32) -> EvictionPolicy:
    if name == "h2o":
        return H2OPolicy()
    if name in ("streaming", "infinigen"):  # infinigen: sinks + recent stay resident
        return StreamingPolicy(sink)
    if name in WINDOW_POLICIES:
        return WindowPolicy(name, window)
    raise ValueError(f"no eviction policy named {name!r}")
