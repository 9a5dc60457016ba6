"""What every eviction policy is: one class with one scoring method; the base
owns the top-k.

A policy sees a layer stack at once, of one request or of several compacted
together from the same length to the same length (their rows stacked,
request-major: L = requests x layers):

    compaction_scores(ctx) -> (L, H, n) float, importance of the j-th oldest
                              resident token of each (row, KV head)
    select(scores, keep, recent) -> (rows, keep) int64 kept indices j, ascending

The worker hands each head's tokens oldest first (after a compaction that
filled holes, through the request's slot order), so "the last r" are the r most
recent tokens and "the first s" the oldest; the indices returned are positions
in that order. Every head keeps the same count, which is what lets the stock
paged attention kernels read the compacted cache unchanged.

A policy declares what the engine must record for it at every step
(`records`, a `Record`), and reads what it needs at compaction time from the
`CompactionContext` the worker hands it (lazily: what it does not read is never
gathered). The rest of the plugin calls this interface and never asks which
policy runs (in the spirit of kvpress's presses: one `score()` per press, the
base class owns top-k).
"""

from __future__ import annotations

import enum
from typing import ClassVar, Protocol

import torch


class Record(enum.Enum):
    """What the engine records for a policy at every step; the worker maps each
    value to a recorder (integration/recorders.py) and calls it unconditionally.

      NOTHING    nothing: the policy scores from what is cached (keys, values,
                 age) at compaction time.
      ATTENTION  the attention every query gives each resident token, summed
                 over the queries and the query heads of a KV head's GQA group:
                 a float32 per (KV head, slot) beside the KV cache, moved with
                 it (core/scoring/scores.py, decode_log.py, chunk_log.py).
                 `CompactionContext.accumulated()` reads it.
      QUERIES    the post-RoPE queries of each request's newest `--kv-window`
                 tokens (core/scoring/query_window.py).
                 `CompactionContext.window()` reads them.
    """

    NOTHING = "nothing"
    ATTENTION = "attention"
    QUERIES = "queries"

    @property
    def per_slot(self) -> bool:
        """Scores live per KV slot: a request starting with shared blocks (prefix
        hit, prompt modules) scores their tokens in private rows instead
        (core/scoring/private_scores.py; the scheduler names such requests)."""
        return self is Record.ATTENTION


class CompactionContext(Protocol):
    """What a policy may read at a compaction, for one layer stack of the
    requests compacted together (L rows = requests x layers, request-major;
    H KV heads, n = `old_len` resident tokens, oldest first). Every method
    gathers on first call and caches."""

    num_layers: int  # rows: requests x layers
    num_kv_heads: int
    old_len: int  # resident tokens before the compaction
    new_len: int  # tokens kept
    recent: int  # the newest tokens always kept (the plan's recent window)
    device: torch.device

    def keys(self) -> torch.Tensor:
        """(L, H, n, D) the cached (post-RoPE) keys, oldest first."""

    def values(self) -> torch.Tensor:
        """(L, H, n, D) the cached values, oldest first."""

    def accumulated(self) -> torch.Tensor:
        """(L, H, n) float32 accumulated attention (Record.ATTENTION)."""

    def window(self) -> tuple[torch.Tensor, float] | None:
        """((L, w, H_q, D) queries of the request's newest w tokens, oldest
        first, and the attention scale) (Record.QUERIES), or None when the
        ring holds no window for this compaction (e.g. a prompt that came from
        elsewhere)."""

    def window_attention_sums(self, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """(L, H, n) float32 attention of the (L, w, H_q, D) window queries
        `q` summed per token over queries and query heads (SnapKV's raw
        scores), oldest first, computed where the keys lie; or None where the
        context cannot (the policy then scores `keys()`)."""

    def window_value_projection(self, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """(L, H, n) float32 AnDPro raw scores of the window queries `q`
        (`window_scores.value_projection`), oldest first, computed where the
        keys and values lie; or None where the context cannot (the policy
        then scores `keys()` and `values()`)."""


class PolicySettingError(ValueError):
    """A setting this policy cannot run with; the config names the flag of
    `key` (core/config/settings.py turns it into an EvictionConfigError)."""

    def __init__(self, key: str, text: str) -> None:
        super().__init__(f"{key} {text}")
        self.key, self.text = key, text


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
    # The count-th lowest value: the same on any device. kthvalue, not topk's
    # last value: 5x faster on CPU at a compaction's (L * H, 96) scores.
    cut = s.kthvalue(count, dim=1, keepdim=True).values
    below = s < cut
    tied = s == cut
    rank = tied.cumsum(1) if oldest_first else tied.flip(1).cumsum(1).flip(1)
    return below | (tied & (rank <= count - below.sum(1, keepdim=True)))


class EvictionPolicy:
    """A policy: what to record each step (`records`) and how to score the
    resident tokens at a compaction (`compaction_scores`). The base keeps the
    `recent` newest tokens plus the best-scored older ones (`select`).

    The default scores every token 0, so the kept set depends on age alone
    (the recent window plus the oldest tokens, ties going to the oldest);
    a policy overrides `compaction_scores`, and `select` only when its kept set
    is not "recent + top-scored" (StreamingLLM's sinks)."""

    name: ClassVar[str]
    records: ClassVar[Record] = Record.NOTHING
    # Rows are scored each on its own, so requests that compact in the same
    # step with the same lengths share one call (one gather, one kernel call).
    # A policy that compares rows (e.g. budgets across layers) sets False and
    # sees one request's layers per call.
    batch_requests: ClassVar[bool] = True

    def compaction_scores(self, ctx: CompactionContext) -> torch.Tensor:
        """(L, H, old_len) importance of each resident token, oldest first."""
        return torch.zeros(ctx.num_layers, ctx.num_kv_heads, ctx.old_len, device=ctx.device)

    def select(self, scores: torch.Tensor, keep: int, recent: int) -> torch.Tensor:
        """(H, n) scores -> (H, keep) ascending kept indices."""
        return recent_plus_top_scored(scores, keep, recent)

    def selects_top_scored(self) -> bool:
        """Whether `select` is `recent_plus_top_scored` (not overridden), so a
        compaction may take the compiled kernel's selection of the same set
        (compaction.select_and_fill_holes)."""
        return type(self).select is EvictionPolicy.select

    @classmethod
    def build(cls, sink: int, window: int) -> "EvictionPolicy":
        """The policy with the settings it takes (--kv-sink, --kv-window)."""
        return cls()

    @classmethod
    def check(cls, budget: int | float, sink: int, window: int) -> None:
        """Refuse settings this policy cannot run with (PolicySettingError)."""

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


class DenseContext:
    """A `CompactionContext` over tensors already in hand (tests, gpu_check,
    references): k, v (L, H, n, D) oldest first; accumulated (L, H, n);
    window (L, w, H_q, D) queries with their scale."""

    def __init__(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                 accumulated: torch.Tensor | None = None,
                 window: tuple[torch.Tensor, float] | None = None,
                 new_len: int = 0, recent: int = 0) -> None:
        shape = next(x.shape for x in (k, v, accumulated) if x is not None)
        self.num_layers, self.num_kv_heads, self.old_len = shape[:3]
        self.device = next(x.device for x in (k, v, accumulated) if x is not None)
        self.new_len, self.recent = new_len, recent
        self._k, self._v, self._acc, self._window = k, v, accumulated, window

    def keys(self) -> torch.Tensor:
        return self._k

    def values(self) -> torch.Tensor:
        return self._v

    def accumulated(self) -> torch.Tensor:
        return self._acc

    def window(self) -> tuple[torch.Tensor, float] | None:
        return self._window

    def window_attention_sums(self, q: torch.Tensor, scale: float) -> None:
        return None  # the keys are in hand: the policy scores them

    def window_value_projection(self, q: torch.Tensor, scale: float) -> None:
        return None  # the keys and values are in hand: the policy scores them
