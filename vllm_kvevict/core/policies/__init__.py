"""Eviction policies: given per-head scores over resident tokens, pick what stays.

A policy sees one layer of one request at a time:

    scores: (num_kv_heads, n)   float, importance of the j-th oldest resident token
    returns (num_kv_heads, keep) int64, kept indices j, ascending per head

The worker hands each head's tokens oldest first (after a compaction that
filled holes, through the request's slot order), so "the last r" are the r most
recent tokens and "the first s" the oldest; the indices returned are positions
in that order. Every head keeps the same count, which is what lets the stock paged
attention kernels read the compacted cache unchanged.

Each policy declares what it needs from the engine, and the rest of the plugin
reads those declarations, never the policy's name (in the spirit of kvpress's
presses). Adding a policy is one class here, one line in `POLICIES`, and tests:
  needs_scores   accumulate attention into a per-slot score buffer at every
                 step (prefill and decode), as H2O does;
  window         > 0: scored at each compaction by the last `window` queries
                 (`scores`), which the worker keeps for it.
The prefix cache and prompt modules follow from them (integration/spec.py): a
policy that needs_scores scores a request's shared first blocks in private
rows (core/scoring/private_scores.py); a window policy's window is the newest queries
the request computed, so after a prefix hit it holds the uncached end of the
prompt (at most `window` tokens, at least one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


def recent_plus_top_scored(scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
    """The `recent` newest tokens plus the `keep - recent` older tokens with the
    largest scores: (H, n) -> (H, keep) ascending indices. Among equal scores at
    the cut the newer tokens stay, so the kept set is a function of the scores
    alone: the same on every device and rank (top-k breaks ties by whatever
    order its kernel visits them, and SnapKV/AnDPro's pooled chunk scores tie
    by design; the GPU check caught CUDA and CPU keeping different tokens).

    A compaction usually drops one block of many (n - keep << keep): then the
    dropped tokens are the ones found (the n - keep lowest), and a mask gives
    the kept ones in ascending order without a sort, many times faster than
    a top-k of the kept and a sort (docs/results.md; scripts/measure/select_timing.py)."""
    num_heads, n = scores.shape
    assert 0 <= recent <= keep <= n, (recent, keep, n)
    old, heavy = n - recent, keep - recent  # older tokens; how many of them stay
    s = scores[:, :old]
    if n - keep < heavy:  # find the dropped: the lowest, the oldest among ties at the cut
        kept = ~_lowest(s, old - heavy, oldest_first=True)
    else:  # find the kept: the highest, the newest among ties at the cut
        kept = _lowest(-s, heavy, oldest_first=False)
    older = kept.nonzero()[:, 1].view(num_heads, heavy)  # row-major: ascending per row
    tail = torch.arange(old, n, device=scores.device).expand(num_heads, -1)
    return torch.cat([older, tail], dim=1)


def _lowest(s: torch.Tensor, count: int, oldest_first: bool) -> torch.Tensor:
    """(H, m) -> (H, m) bool marking each row's `count` lowest values; ties at
    the cut go to the oldest (lowest index) or newest entries, deterministically."""
    marked = torch.zeros_like(s, dtype=torch.bool)
    if count == 0:
        return marked
    cut = torch.topk(s, count, dim=1, largest=False).values[:, -1:]  # the same on any device
    below = s < cut
    tied = s == cut
    rank = tied.cumsum(1) if oldest_first else tied.flip(1).cumsum(1).flip(1)
    return below | (tied & (rank <= count - below.sum(1, keepdim=True)))


class EvictionPolicy(ABC):
    name: ClassVar[str]
    needs_scores: ClassVar[bool] = False
    window: int = 0

    @abstractmethod
    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        """(H, n) scores -> (H, keep) ascending kept slot indices."""

    @classmethod
    def build(cls, sink: int, window: int) -> "EvictionPolicy":
        """The policy with the settings it takes (--kv-sink, --kv-window)."""
        return cls()

    @classmethod
    def default_recent(cls, budget: int, window: int) -> int:
        """The recent window inside `budget` when --kv-recent is not given."""
        return budget // 2

    @classmethod
    def recent_in_force(cls, budget: int | float, recent: int | float | None,
                        sink: int, window: int) -> str:
        """The recent window this policy keeps, as /metrics shows it: a count
        under a token budget, a fraction of each request's length under a
        fractional one."""
        if recent is not None:
            return f"{recent:g}"
        if isinstance(budget, int):
            return str(cls.default_recent(budget, window))
        return f"{budget / 2:g}"


class H2OPolicy(EvictionPolicy):
    """Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048, Algorithm 1).

    Keeps the `recent` newest tokens plus the `keep - recent` older tokens with
    the largest accumulated attention (summed over the query heads of each KV
    head's GQA group). Evicting in one batch of many tokens equals running the
    paper's one-at-a-time greedy step repeatedly with frozen scores. The
    default split is the paper's: half heavy hitters, half recent. A request
    that starts from cached blocks (prefix hit, prompt modules) counts the
    queries it computed: the cached prefix's own queries are not run again.
    """

    name = "h2o"
    needs_scores = True

    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        return recent_plus_top_scored(scores, keep, recent)


class StreamingPolicy(EvictionPolicy):
    """StreamingLLM (Xiao et al. 2023): the first `sink` tokens + the newest ones."""

    name = "streaming"

    def __init__(self, sink: int = 4) -> None:
        self.sink = sink

    @classmethod
    def build(cls, sink: int, window: int) -> "StreamingPolicy":
        return cls(sink)

    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        num_heads, n = scores.shape
        sink = min(self.sink, keep)
        idx = torch.cat([torch.arange(sink), torch.arange(n - (keep - sink), n)])
        return idx.to(scores.device).expand(num_heads, -1).contiguous()

    @classmethod
    def recent_in_force(cls, budget: int | float, recent: int | float | None,
                        sink: int, window: int) -> str:
        # Everything but the sinks is the recent window; --kv-recent plays no part.
        return str(budget - min(sink, budget)) if isinstance(budget, int) else f"{budget:g} - {sink}"


class WindowPolicy(EvictionPolicy):
    """Scored by an observation window (SnapKV, AnDPro): at each compaction, the
    last `window` queries score every resident token
    (`vllm_kvevict.core.scoring.window_scores`), and the kept set is the recent tokens
    (the window itself, unless the budget is under two windows: then half the
    budget) plus the best-scored older ones.

    The papers compress the prompt once, after it is read; here the same rule
    also runs during decode, once per block of new tokens, with the latest
    `window` tokens (prompt or generated) as the window. Every KV head keeps the
    same count: the papers' cross-head budget allocation (Ada-KV style) needs a
    per-head length the stock kernels lack.
    """

    def __init__(self, window: int = 32) -> None:
        self.window = window

    @classmethod
    def build(cls, sink: int, window: int) -> "WindowPolicy":
        return cls(window)

    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        return recent_plus_top_scored(scores, keep, recent)

    @classmethod
    def default_recent(cls, budget: int, window: int) -> int:
        return min(window, budget // 2)  # the papers keep their window

    @classmethod
    def recent_in_force(cls, budget: int | float, recent: int | float | None,
                        sink: int, window: int) -> str:
        if recent is None and not isinstance(budget, int):
            return f"min({window}, {budget / 2:g})"  # a token count or half the budget
        return super().recent_in_force(budget, recent, sink, window)

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, recent: int | None = None) -> torch.Tensor:
        """(B, w, H_q, D), (B, H, n, D) x2 -> (B, H, n) selection scores; the
        `recent` newest tokens (default: the window) are the ones always kept."""
        from vllm_kvevict.core.scoring.window_scores import window_scores

        return window_scores(self.name, q, k, v, scale, recent)


class SnapKVPolicy(WindowPolicy):
    """SnapKV (Li et al. 2024): a token's score is the attention the window's
    queries give it, pooled."""

    name = "snapkv"


class AnDProPolicy(WindowPolicy):
    """AnDPro (anchor direction projection): a token's score is its weighted
    value's projection on the pre-eviction output, a_i * <y, v_i>, pooled."""

    name = "andpro"


# --kv-eviction name -> the policy that decides what stays resident. infinigen
# keeps StreamingLLM's sinks + recent window resident and offloads the rest.
POLICIES: dict[str, type[EvictionPolicy]] = {
    "h2o": H2OPolicy, "streaming": StreamingPolicy, "snapkv": SnapKVPolicy,
    "andpro": AnDProPolicy, "infinigen": StreamingPolicy,
}


def make_policy(name: str, sink: int = 4, window: int = 32) -> EvictionPolicy:
    """The policy `--kv-eviction name` runs, with the settings it takes."""
    if name not in POLICIES:
        raise ValueError(f"no eviction policy named {name!r}")
    return POLICIES[name].build(sink, window)
