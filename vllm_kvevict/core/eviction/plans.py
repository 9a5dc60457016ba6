"""The only data that crosses from the scheduler to the workers: small and plain.

One `EvictionStep` rides on each `SchedulerOutput` as the attribute
`kv_eviction` (see patches/scheduler_schedule.py). Workers of every TP rank get
the same step and compact their own KV heads with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STEP_ATTR = "kv_eviction"


@dataclass(frozen=True)
class CompactionPlan:
    """Shrink one request from `old_len` to `new_len` resident tokens.

    The worker keeps new_len of the old tokens (the first cdiv(old_len, bs)
    blocks of `src_block_ids`) in slots [0, new_len) of `dst_block_ids`, in any
    slot order (compaction.fill_holes). dst == src except where a kept block was
    shared or prefix cached: the scheduler then gave the request a private block
    (copy-on-write: copied whole from its source, then written; blocks.py's
    BlockDecision decides which, and builds src and dst). After the plan
    the request's block row is exactly `dst_block_ids`, followed by whatever
    this step allocates.
    `new_len` and `recent` come from the request's own budget (per-request
    `kv_budget` / `kv_recent`, else the server's).
    """

    req_id: str
    group_id: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    old_len: int
    new_len: int
    logical_len: int
    recent: int  # the newest tokens always kept (the request's own settings)


@dataclass
class EvictionStep:
    plans: list[CompactionPlan] = field(default_factory=list)
    # req_id -> logical - physical tokens, for every request that has evicted.
    # Authoritative each step, so workers keep no offset state of their own.
    evicted: dict[str, int] = field(default_factory=dict)
    # Requests whose blocks went back to the pool since the last step (finished,
    # aborted, preempted): workers must stop reading those blocks for them.
    released: list[str] = field(default_factory=list)
    # Requests new this step that can never exceed the budget: nobody will read
    # their scores, so workers do not compute them (planner.never_compacts).
    unscored: list[str] = field(default_factory=list)
    # Requests new this step that compact right after their prompt
    # (planner.evicts_after_prompt): the CPU may fuse their prompt's attention.
    evict_after_prompt: list[str] = field(default_factory=list)
    # H2O: req_id -> n, for requests that start this step with n prompt tokens
    # in blocks others may read (prefix hit, prompt modules): workers score
    # those tokens in private rows (core/scoring/private_scores.py).
    shared_prefix: dict[str, int] = field(default_factory=dict)
