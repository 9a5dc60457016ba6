"""AnDPro: tokens scored by their weighted value's projection on the output."""

from __future__ import annotations

import torch

from vllm_kvevict.core.policies.base import CompactionContext
from vllm_kvevict.core.policies.window import WindowPolicy
from vllm_kvevict.core.scoring.window_scores import value_projection


class AnDProPolicy(WindowPolicy):
    """AnDPro (anchor direction projection): a token's score is its weighted
    value's projection on the pre-eviction output, a_i * <y, v_i>, pooled."""

    name = "andpro"

    def raw_scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> torch.Tensor:
        return value_projection(q, k, v, scale)

    def context_raw_scores(self, ctx: CompactionContext, q: torch.Tensor,
                           scale: float) -> torch.Tensor:
        # Read in place where the context can: gathering every layer's keys
        # and values cost about 90 ms of the main job's andpro run.
        scores = ctx.window_value_projection(q, scale)
        return super().context_raw_scores(ctx, q, scale) if scores is None else scores
