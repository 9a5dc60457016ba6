"""What SnapKV and AnDPro share: an observation window of the newest queries
scores the cache at each compaction (core/scoring/window_scores.py)."""

from __future__ import annotations

import torch

from vllm_kvevict.core.policies.base import CompactionContext, EvictionPolicy, Record
from vllm_kvevict.core.scoring.window_scores import finalize


class WindowPolicy(EvictionPolicy):
    """Scored by an observation window (SnapKV, AnDPro): at each compaction, the
    last `window` queries score every resident token (`raw_scores`, then
    `window_scores.finalize`: pooling, chunks, the window and the first token
    always kept), and the kept set is the recent tokens (the window itself,
    unless the budget is under two windows: then half the budget) plus the
    best-scored older ones.

    The papers compress the prompt once, after it is read; here the same rule
    also runs during decode, once per block of new tokens, with the latest
    `window` tokens (prompt or generated) as the window. Every KV head keeps the
    same count: the papers' cross-head budget allocation (Ada-KV style) needs a
    per-head length the stock kernels lack.
    """

    records = Record.QUERIES
    # AnDPro projects onto the values; SnapKV reads keys only, and gathering
    # the values of every layer at each compaction would cost as much again.
    reads_values = True

    def __init__(self, window: int = 32) -> None:
        self.window = window

    @classmethod
    def build(cls, sink: int, window: int) -> "WindowPolicy":
        return cls(window)

    @classmethod
    def default_recent(cls, budget: int, window: int) -> int:
        return min(window, budget // 2)  # the papers keep their window

    @classmethod
    def recent_in_force(cls, budget: int | float, recent: int | float | None,
                        sink: int, window: int) -> str:
        if recent is None and not isinstance(budget, int):
            return f"min({window}, {budget / 2:g})"  # a token count or half the budget
        return super().recent_in_force(budget, recent, sink, window)

    def raw_scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
        """(B, w, H_q, D), (B, H, n, D) x2 -> (B, H, n) float32 per-token scores
        before pooling (v None where the policy does not read values)."""
        raise NotImplementedError

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               scale: float, recent: int | None = None) -> torch.Tensor:
        """(B, w, H_q, D), (B, H, n, D) x2 -> (B, H, n) selection scores; the
        `recent` newest tokens (default: the window) are the ones always kept."""
        return finalize(self.raw_scores(q, k, v, scale), q.shape[1] if recent is None else recent)

    def compaction_scores(self, ctx: CompactionContext) -> torch.Tensor:
        """Without a window (nothing logged, e.g. a prompt served from
        elsewhere) every older token scores 0: the first and the recent tokens
        are kept."""
        win = ctx.window()
        if win is None:
            scores = torch.zeros(ctx.num_layers, ctx.num_kv_heads, ctx.old_len, device=ctx.device)
            scores[..., 0] = float("inf")
            return scores
        q, scale = win
        return finalize(self.context_raw_scores(ctx, q, scale), ctx.recent)

    def context_raw_scores(self, ctx: CompactionContext, q: torch.Tensor,
                           scale: float) -> torch.Tensor:
        """(L, H, n) `raw_scores` of ctx's tokens for the window queries q."""
        k = ctx.keys()
        v = ctx.values() if self.reads_values else None
        return self.raw_scores(q.to(k.device), k, v, scale)
