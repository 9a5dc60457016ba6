"""SnapKV: tokens scored by the attention of the observation window."""

from __future__ import annotations

import torch

from vllm_kvevict.core.policies.base import CompactionContext
from vllm_kvevict.core.policies.window import WindowPolicy
from vllm_kvevict.core.scoring.window_scores import attention_sums


class SnapKVPolicy(WindowPolicy):
    """SnapKV (Li et al. 2024): a token's score is the attention the window's
    queries give it, pooled."""

    name = "snapkv"
    reads_values = False

    def raw_scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
        return attention_sums(q, k, scale)

    def context_raw_scores(self, ctx: CompactionContext, q: torch.Tensor,
                           scale: float) -> torch.Tensor:
        # Read in place where the context can: gathering every layer's keys
        # cost a fifth of a compaction in the main job.
        sums = ctx.window_attention_sums(q, scale)
        return super().context_raw_scores(ctx, q, scale) if sums is None else sums
