"""H2O: heavy hitters by accumulated attention, plus a recent window."""

from __future__ import annotations

import torch

from vllm_kvevict.core.policies.base import CompactionContext, EvictionPolicy, Record


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
    records = Record.ATTENTION

    def compaction_scores(self, ctx: CompactionContext) -> torch.Tensor:
        return ctx.accumulated()
