"""Which blocks a compaction frees, copies and takes out of the prefix cache.
Plain code on plain data, vLLM-free: the scheduler's KV manager
(integration/spec.py) reads its BlockPool into these values and applies the
answer; tests/test_block_decision.py checks the rules with a fake pool.

A request's block row is `blocks` (row order). Compacting it from `physical`
to `target` resident tokens keeps its first cdiv(target, bs) blocks and gives
the rest (the tail) back. Two kinds of kept block must not be written in place:

- shared (ref_cnt > 1): another request, or the prompt-module store's pin
  (integration/module_store.py), reads it. The request gets a private copy
  (copy-on-write: the worker copies the block whole, then compacts into it) and
  drops its reference on the original.
- prefix-cached and held only by this request (ref_cnt 1, a block hash): copied
  too when the pool can spare copies for it and every shared block, so the
  original stays in the prefix cache unwritten for the next request with the
  same prefix; otherwise it leaves the prefix cache and is compacted in place,
  so a first compaction needs no extra block when the pool is full.

The copies come from the blocks free before the tail is freed. The worker moves
tokens in place (the Triton kernel reads ahead of where it writes), so a
destination block must be its own source block or one no source uses; a freed
tail block still holds kept tokens not yet moved, and vLLM's pool hands freed
hash-less blocks out first (LIFO). While the request holds its tail, no source
is free, so no copy can be a source. When the copies do not fit in what is free
without the tail, the request does not compact this step (it retries once a
block is free or a sharer let go).

Applying a decision, in this order (integration/spec.py does it on vLLM's pool):
  1. allocate `num_new_blocks` blocks (the private copies);
  2. cut the row to `keep` blocks and free `free_ids` (the tail, newest first);
  3. take `uncache_ids` out of the prefix cache;
  4. put the new blocks at `copy_rows` and free the originals (`release_ids`);
  5. send CompactionPlan(src_block_ids, dst_block_ids(new ids), ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.planner import compaction_target


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Block:
    """What the decision reads of one block of a request's row."""

    block_id: int
    ref_cnt: int = 1  # holders: this request, other requests, the module store's pin
    cached: bool = False  # registered in the prefix cache (vLLM: has a block hash)

    @property
    def shared(self) -> bool:
        return self.ref_cnt > 1


@dataclass(frozen=True)
class BlockDecision:
    """One request's compaction, as block operations (applied in the order of
    the module docstring)."""

    old_len: int  # physical tokens before
    new_len: int  # physical tokens after (the target)
    src_block_ids: tuple[int, ...]  # the blocks holding the old tokens (the plan's src)
    keep: int  # blocks the row keeps: cdiv(new_len, bs)
    copy_rows: tuple[int, ...]  # kept rows that get a private copy, ascending
    free_ids: tuple[int, ...]  # the tail, in the order to free (newest first)
    uncache_ids: tuple[int, ...]  # kept blocks leaving the prefix cache (compacted in place)
    release_ids: tuple[int, ...]  # the originals of copy_rows, freed once swapped
    blocks_freed: int  # tail blocks that return to the free queue (only we held them)

    @property
    def num_new_blocks(self) -> int:
        """Blocks to allocate for the private copies, before the tail is freed."""
        return len(self.copy_rows)

    @property
    def tokens_evicted(self) -> int:
        return self.old_len - self.new_len

    def dst_block_ids(self, new_ids: Sequence[int]) -> tuple[int, ...]:
        """The plan's dst row: the kept blocks, with the new blocks (in
        allocation order) at `copy_rows`. Refuses new blocks that break the
        in-place precondition (a new block that is one of the sources)."""
        new_ids = tuple(new_ids)
        if len(new_ids) != len(self.copy_rows):
            raise ValueError(f"{len(self.copy_rows)} private copies need as many new "
                             f"blocks, got {len(new_ids)}")
        if set(new_ids) & set(self.src_block_ids) or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"new blocks {new_ids} must be distinct and none a source "
                             f"{self.src_block_ids}: the worker compacts in place")
        dst = list(self.src_block_ids[:self.keep])
        for row, block_id in zip(self.copy_rows, new_ids):
            dst[row] = block_id
        return tuple(dst)


def decide_blocks(blocks: Sequence[Block], physical: int, target: int, block_size: int,
                  num_free: int) -> BlockDecision | None:
    """The block operations that compact a request from `physical` to `target`
    tokens, or None when the private copies do not fit in the `num_free` blocks
    free now (retry at a later step)."""
    _check_row(blocks, physical, block_size)
    if not 0 <= target < physical:
        raise ValueError(f"target {target} must lie in [0, physical {physical})")
    if num_free < 0:
        raise ValueError(f"free block count {num_free} < 0")
    keep = cdiv(target, block_size)
    src = blocks[:cdiv(physical, block_size)]
    kept, tail = blocks[:keep], blocks[keep:]
    shared = [i for i, b in enumerate(kept) if b.shared]
    cached = [i for i, b in enumerate(kept) if not b.shared and b.cached]
    if cached and len(shared) + len(cached) <= num_free:
        copies, uncache = sorted(shared + cached), []  # the cached originals stay unwritten
    else:
        copies, uncache = shared, cached  # compacted in place: out of the prefix cache
    if len(copies) > num_free:
        return None  # no room for private copies yet
    return BlockDecision(
        old_len=physical, new_len=target,
        src_block_ids=tuple(b.block_id for b in src), keep=keep,
        copy_rows=tuple(copies),
        free_ids=tuple(b.block_id for b in reversed(tail)),
        uncache_ids=tuple(kept[i].block_id for i in uncache),
        release_ids=tuple(kept[i].block_id for i in copies),
        blocks_freed=sum(not b.shared for b in tail))


def room_for_next_chunk(num_blocks: int, physical: int, remaining: int, block_size: int,
                        chunk_tokens: int | None, num_free: int, other_requests: int) -> bool:
    """Can the pool hold this request's next prompt chunk (at most `remaining`
    prompt tokens, at most the scheduler's chunk) and still give one block to
    each of the `other_requests` holding blocks (a decode step's next block)?
    If not, the prompt is compacted between chunks (planner.compaction_target)."""
    chunk = min(remaining, chunk_tokens or remaining)
    need = cdiv(physical + chunk, block_size) - num_blocks
    return need + other_requests <= num_free


@dataclass(frozen=True)
class RequestState:
    """What the scheduler knows of one request at a compaction point (every
    allocation: read cheaply, the block row only once it compacts)."""

    num_blocks: int  # blocks in its row
    logical: int  # tokens computed (RoPE positions)
    evicted: int  # logical - physical so far
    num_prompt_tokens: int | None = None  # None: not asked about prefill
    has_plan: bool = False  # already compacted this step (one plan per step)
    finishing: bool = False  # vLLM is finishing it: not a compaction point
    new_tokens: int = 1  # a decode step's tokens: 1 + its speculative draft tokens

    @property
    def physical(self) -> int:
        return self.logical - self.evicted

    @property
    def in_prefill(self) -> bool:
        return self.num_prompt_tokens is not None and self.logical < self.num_prompt_tokens


@dataclass(frozen=True)
class PoolView:
    """What the scheduler knows of the block pool and the other requests."""

    num_free: int  # blocks free now
    other_requests: int = 0  # other requests holding blocks in this group
    chunk_tokens: int | None = None  # the scheduler's prefill chunk (None: unbounded)


def compaction_point(cfg: EvictionConfig, req: RequestState, pool: PoolView,
                     block_size: int) -> int | None:
    """The physical length `req` compacts to now, or None: the planner's rule
    (planner.compaction_target) with the prefill room read from the pool. A
    request with no blocks, being finished, or already holding a plan this step
    does not compact."""
    if req.num_blocks == 0 or req.finishing:
        return None
    if not 0 <= req.evicted <= req.logical:
        raise ValueError(f"evicted {req.evicted} must lie in [0, logical {req.logical}]")
    room = not req.in_prefill or room_for_next_chunk(
        req.num_blocks, req.physical, req.num_prompt_tokens - req.logical, block_size,
        pool.chunk_tokens, pool.num_free, pool.other_requests)
    target = compaction_target(cfg, req.physical, req.logical, req.in_prefill, block_size, room,
                               req.new_tokens)
    return None if req.has_plan else target


def plan_blocks(cfg: EvictionConfig, req: RequestState, blocks: Sequence[Block],
                pool: PoolView, block_size: int) -> BlockDecision | None:
    """compaction_point, then decide_blocks: the whole decision for one
    request, or None when it does not compact this step."""
    if len(blocks) != req.num_blocks:
        raise ValueError(f"row of {len(blocks)} blocks, state says {req.num_blocks}")
    target = compaction_point(cfg, req, pool, block_size)
    if target is None:
        return None
    return decide_blocks(blocks, req.physical, target, block_size, pool.num_free)


def _check_row(blocks: Sequence[Block], physical: int, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block size {block_size} must be positive")
    if physical > len(blocks) * block_size:
        raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold "
                         f"{physical} tokens")
    if len({b.block_id for b in blocks}) != len(blocks):
        raise ValueError(f"a block appears twice in the row {[b.block_id for b in blocks]}")
    bad = [b.block_id for b in blocks if b.ref_cnt < 1]
    if bad:
        raise ValueError(f"blocks {bad} in a request's row must have ref_cnt >= 1")


# --- prompt modules: which blocks the store pins and an importer opens with -------

def module_pin_blocks(num_computed: int, num_prompt: int, block_size: int) -> int:
    """Blocks a finished module encode leaves pinned: its full blocks of prompt
    tokens (a partial last block would be written by an importer's own tokens)."""
    return min(num_computed, num_prompt) // block_size


def module_imports(imports: Sequence[tuple[str, int]], token_ids: Sequence[int],
                   positions: Sequence[int],
                   entries: dict[str, tuple[Sequence[int], Sequence[int]]],
                   block_size: int) -> tuple[list[tuple[str, int]], int, bool]:
    """The pinned blocks a request opens with: per import in order, (key, blocks
    taken from the start of that entry) while each import is whole blocks of
    an entry holding exactly the request's own tokens at its own positions
    (`entries`: key -> (tokens, positions)); then the tokens they hold, and
    whether every import matched (only then may vLLM's prefix cache extend
    the hit). Stops at the first that does not: the rest is computed."""
    out, n = [], 0
    for key, count in imports:
        entry = entries.get(key)
        if (entry is None or count % block_size or count > len(entry[0])
                or tuple(token_ids[n:n + count]) != tuple(entry[0][:count])
                or tuple(positions[n:n + count]) != tuple(entry[1][:count])):
            return out, n, False
        out.append((key, count // block_size))
        n += count
    return out, n, True


def trim_hit(num_tokens_hit: int, num_tokens: int, block_size: int) -> int:
    """vLLM must compute at least a request's last token: a hit covering all
    of it gives its last block back."""
    return num_tokens_hit - block_size if num_tokens_hit >= num_tokens else num_tokens_hit
