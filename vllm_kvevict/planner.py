"""When to compact a request, and to what length. Pure arithmetic, vLLM-free.

A request has a logical length L (RoPE positions keep growing) and a physical
length P <= L (KV entries resident). The scheduler owns this rule and the worker
just executes its plans, so both sides agree by construction.

    decode:        compact when P >= budget + block_size, back down to budget.
                   Compaction then runs once per block of new tokens, and a
                   request never holds more than budget + block_size tokens.
    offload (InfiniGen): no compaction during prefill; decode as above, and
                   the evicted tokens go to the host tier.
    chunked prefill: before each new prompt chunk, compact when P > budget, so a
                   prompt far longer than the budget never holds more than
                   budget + one chunk.
"""

from __future__ import annotations

from vllm_kvevict.config import EvictionConfig


def compaction_target(cfg: EvictionConfig, physical: int, logical: int,
                      in_prefill: bool, block_size: int) -> int | None:
    """New physical length if the request should be compacted now, else None."""
    if not cfg.enabled or (cfg.offload and in_prefill):
        # Offload: the prompt is prefilled whole (every chunk attends every
        # earlier prompt token, as in InfiniGen), then moves to the host tier.
        return None
    budget = cfg.budget_tokens(logical, block_size)
    limit = budget if in_prefill else budget + block_size - 1
    return budget if physical > limit else None


def never_compacts(cfg: EvictionConfig, prompt_len: int, max_tokens: int) -> bool:
    """True when a request can never exceed a token budget: its scores would
    never be read, so the workers skip scoring it (most chat requests under the
    default 1024-token budget). Fractional budgets always may compact."""
    return (cfg.enabled and isinstance(cfg.budget, int)
            and prompt_len + max_tokens <= cfg.budget)


def max_blocks_per_request(budget: int, block_size: int) -> int:
    """The bound the issue states for decode: ceil((budget + bs) / bs) + 1."""
    return -(-(budget + block_size) // block_size) + 1
