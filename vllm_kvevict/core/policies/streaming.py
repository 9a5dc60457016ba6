"""StreamingLLM: attention sinks plus the newest tokens."""

from __future__ import annotations

import torch

from vllm_kvevict.core.policies.base import EvictionPolicy, PolicySettingError


class StreamingPolicy(EvictionPolicy):
    """StreamingLLM (Xiao et al. 2023): the first `sink` tokens + the newest ones.
    Nothing is recorded or scored: the kept set depends on age alone. Also the
    resident set under InfiniGen offload (`--kv-eviction infinigen`)."""

    name = "streaming"

    def __init__(self, sink: int = 4) -> None:
        self.sink = sink

    @classmethod
    def build(cls, sink: int, window: int) -> "StreamingPolicy":
        return cls(sink)

    @classmethod
    def check(cls, budget: int | float, sink: int, window: int) -> None:
        if isinstance(budget, int) and sink >= budget:
            raise PolicySettingError(
                "kv_sink", f"({sink}) must be smaller than --kv-budget ({budget})")

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
