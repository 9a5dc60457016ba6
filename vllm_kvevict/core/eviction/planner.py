"""When to compact a request, and to what length. Pure arithmetic, vLLM-free.

A request has a logical length L (RoPE positions keep growing) and a physical
length P <= L (KV entries resident). The scheduler owns this rule and the worker
just executes its plans, so both sides agree by construction. Which blocks a
compaction then frees, copies or takes out of the prefix cache is decided in
blocks.py (compaction_point calls this with the pool's prefill room).

    decode:        the budget caps blocks: a request may fill the
                   ceil(budget / block_size) blocks the budget needs (its
                   block cap, EvictionConfig.block_cap). Compact when the next
                   token would take P past that cap, back down to cap - room,
                   room being one block (EvictionConfig.compaction_room), i.e.
                   to the whole blocks below the budget's last one. Compaction
                   then runs once per block of new tokens, and a request never
                   holds more than the budget's blocks. (A token cap, compacting
                   at the budget to budget - room, held the same blocks but
                   left up to a block of their slots empty: at 10% of a
                   1K-token prompt it kept 69 tokens where this keeps 96.)
    offload (InfiniGen): no compaction during prefill; decode as above, and
                   the evicted tokens go to the host tier.
    prefill (default): the prompt stays whole, and its first decode step
                   compacts it (decode's rule: P = prompt length), so the policy
                   scores every prompt token with every prompt query, the
                   question at its end included: compaction is decided after the
                   question, not before.
    prefill, memory short (or P past --kv-prefill-cap): before the next prompt
                   chunk, compact when P > cap (to cap - room), so a prompt
                   far longer than the pool holds at most its budget's blocks
                   plus one chunk.
"""

from __future__ import annotations

from vllm_kvevict.core.config.settings import EvictionConfig


def compaction_target(cfg: EvictionConfig, physical: int, logical: int,
                      in_prefill: bool, block_size: int, room: bool = True,
                      new_tokens: int = 1) -> int | None:
    """New physical length if the request should be compacted now, else None.

    room: in prefill, whether the pool can hold the request's next prompt chunk
          (the scheduler's view); without it the prompt is compacted between
          chunks rather than the request preempted or refused.
    new_tokens: in decode, the tokens the step writes: 1, or 1 + its draft
          tokens under speculative decoding (those rejected are rolled back
          from `logical` before the next step). The step must fit in the
          block cap, so a compaction leaves at least that much room.
    """
    if not cfg.enabled or (cfg.offload and in_prefill):
        # Offload: the prompt is prefilled whole (every chunk attends every
        # earlier prompt token, as in InfiniGen), then moves to the host tier.
        return None
    if in_prefill:
        if room and (cfg.prefill_cap is None or physical <= cfg.prefill_cap):
            return None  # decide after the question: the prompt stays whole
        budget = cfg.budget_tokens(logical, block_size)
    else:
        # Decode writes new_tokens: afterwards the request may fill the block
        # cap of its new length's budget (a fraction of 1.0 then never compacts).
        budget = cfg.budget_tokens(logical + new_tokens, block_size)
        physical += new_tokens
    cap = cfg.block_cap(budget, block_size)
    if physical <= cap:
        return None
    # One block of room, or (a one-block cap, whose room is one token) what
    # the step's drafts need: startup keeps them under a block (spec_decode.py).
    return min(cfg.compaction_keep(budget, block_size), cap - (0 if in_prefill else new_tokens))


def never_compacts(cfg: EvictionConfig, prompt_len: int, max_tokens: int,
                   drafts: int = 0) -> bool:
    """True when a request can never exceed a token budget: its scores would
    never be read, so the workers skip scoring it (most chat requests under the
    default 1024-token budget). Fractional budgets always may compact.
    drafts: speculative tokens per step, which vLLM may propose past max_tokens."""
    return (cfg.enabled and isinstance(cfg.budget, int)
            and prompt_len + max_tokens + drafts <= cfg.budget)


def evicts_after_prompt(cfg: EvictionConfig, prompt_len: int, block_size: int) -> bool:
    """True when a request compacts as soon as its prompt is in (its first
    decode step, compaction_target's own test): its tokens differ from stock
    vLLM's from the second on, so no identity promise covers it and the CPU
    may run its prompt through the fused attention pass (integration/fused_attention.py)."""
    return (cfg.enabled and not cfg.offload
            and compaction_target(cfg, prompt_len, prompt_len, False, block_size) is not None)


def max_blocks_per_request(budget: int, block_size: int) -> int:
    """The most blocks a decoding request holds: ceil(budget / bs), the blocks
    of its block cap."""
    return EvictionConfig.block_cap(budget, block_size) // block_size
