"""The block decision (core/eviction/blocks.py) on plain data: which blocks a
compaction frees, copies and takes out of the prefix cache, with a tiny fake
pool standing in for vLLM's BlockPool. No vLLM here: the same rules applied to
vLLM's own BlockPool are tested in test_compaction_safety.py, test_engine.py
and the prefix-cache / prompt-module tests.
"""

import random

import pytest

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.blocks import (
    Block, PoolView, RequestState, compaction_point, decide_blocks, module_imports,
    module_pin_blocks, plan_blocks, room_for_next_chunk, trim_hit)

BS = 16
# A 5-block cap: a compaction keeps 4 blocks (planner.compaction_room).
CFG = EvictionConfig.from_dict({"kv_eviction": "streaming", "kv_budget": 5 * BS})


class FakePool:
    """vLLM's BlockPool, reduced to what a compaction touches: ref counts, the
    prefix cache (block ids with a hash) and the free queue (freed hash-less
    blocks are handed out first, as vLLM's LIFO does; cached ones last)."""

    def __init__(self, n):
        self.ref = dict.fromkeys(range(n), 0)
        self.cached: set[int] = set()
        self.free = list(range(n))  # handed out from the front

    def alloc(self, n):
        assert n <= len(self.free), "pool exhausted"
        out, self.free = self.free[:n], self.free[n:]
        for b in out:
            self.cached.discard(b)  # reuse evicts a cached block
            self.ref[b] = 1
        return out

    def touch(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1

    def release(self, ids):
        first, last = [], []
        for b in ids:
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                (last if b in self.cached else first).append(b)
        self.free = first + self.free + last  # prepend_n / append_n keep the order

    def view(self, row):
        return [Block(b, self.ref[b], b in self.cached) for b in row]


def apply(pool, row, d):
    """What integration/spec.py's _apply does to vLLM's pool, on the fake one."""
    new = pool.alloc(d.num_new_blocks)
    del row[d.keep:]
    pool.release(d.free_ids)
    pool.cached.difference_update(d.uncache_ids)
    for r, b, old in zip(d.copy_rows, new, d.release_ids):
        pool.release([old])
        row[r] = b
    return d.dst_block_ids(new)


def request(pool, n_blocks):
    return pool.alloc(n_blocks)


# --- nothing to do -----------------------------------------------------------------

@pytest.mark.parametrize("state", [
    RequestState(num_blocks=5, logical=5 * BS - 1, evicted=0),  # below the budget
    RequestState(num_blocks=0, logical=0, evicted=0),  # no blocks yet
    RequestState(num_blocks=7, logical=7 * BS, evicted=0, finishing=True),  # vLLM finishing it
    RequestState(num_blocks=7, logical=7 * BS, evicted=0, has_plan=True),  # one plan a step
    RequestState(num_blocks=7, logical=7 * BS, evicted=0, num_prompt_tokens=10 * BS),  # room
])
def test_nothing_to_do(state):
    assert compaction_point(CFG, state, PoolView(num_free=100), BS) is None


def test_nothing_to_do_without_eviction_or_offloaded_prefill():
    state = RequestState(num_blocks=7, logical=7 * BS, evicted=0, num_prompt_tokens=10 * BS)
    none = EvictionConfig.from_dict({"kv_eviction": "none"})
    assert compaction_point(none, state, PoolView(num_free=0), BS) is None
    # offload keeps a prompt whole, even with no room for its next chunk
    off = EvictionConfig.from_dict({"kv_eviction": "streaming", "kv_budget": 4 * BS,
                                   "kv_swap_space": 1})
    assert off.offload
    assert compaction_point(off, state, PoolView(num_free=0), BS) is None


# --- tail frees --------------------------------------------------------------------

def test_private_row_frees_its_tail_newest_first():
    pool = FakePool(12)
    row = request(pool, 8)  # 7 full blocks + one allocated ahead
    state = RequestState(num_blocks=8, logical=7 * BS + 3, evicted=0)
    d = plan_blocks(CFG, state, pool.view(row), PoolView(num_free=4), BS)
    assert (d.old_len, d.new_len, d.keep, d.tokens_evicted) == (7 * BS + 3, 4 * BS, 4, 3 * BS + 3)
    assert d.src_block_ids == tuple(row)  # cdiv(115, 16) = 8 blocks hold the tokens
    assert d.free_ids == tuple(reversed(row[4:])) and d.blocks_freed == 4
    assert (d.copy_rows, d.uncache_ids, d.release_ids, d.num_new_blocks) == ((), (), (), 0)
    before = list(row)
    assert apply(pool, row, d) == tuple(before[:4]) == tuple(row)
    assert len(pool.free) == 8 and pool.free[0] == before[-1]  # the newest is reused first


def test_a_shared_tail_block_is_released_but_not_freed():
    pool = FakePool(12)
    row = request(pool, 7)
    pool.touch([row[6]])  # another request reads the newest block
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=len(pool.free))
    assert d.free_ids == tuple(reversed(row[4:])) and d.blocks_freed == 2
    apply(pool, list(row), d)
    assert pool.ref[row[6]] == 1 and row[6] not in pool.free


def test_target_after_earlier_evictions_and_the_evicted_count():
    pool = FakePool(12)
    row = request(pool, 5)
    state = RequestState(num_blocks=5, logical=300, evicted=300 - 5 * BS)  # physical 80
    assert state.physical == 5 * BS
    d = plan_blocks(CFG, state, pool.view(row), PoolView(num_free=7), BS)
    assert (d.new_len, d.tokens_evicted, d.free_ids) == (4 * BS, BS, (row[4],))


# --- copy-on-write of shared kept blocks -------------------------------------------

def test_shared_kept_block_gets_a_private_copy_taken_before_the_tail_is_freed():
    """Issue 20 #1: in a pool with one spare block, that block is the copy; the
    request's just-freed tail (which still holds kept tokens) never is."""
    pool = FakePool(1 + 7 + 1)
    row = request(pool, 7)
    pool.touch([row[0]])  # "b" shares the first block
    filler = pool.alloc(len(pool.free) - 1)
    spare = pool.free[0]
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=1)
    assert (d.copy_rows, d.release_ids, d.num_new_blocks) == ((0,), (row[0],), 1)
    src = list(row)
    dst = apply(pool, row, d)
    assert dst == (spare, *src[1:4]) and row == list(dst)
    assert all(b == s or b not in src for b, s in zip(dst, src))  # in-place precondition
    assert pool.ref[src[0]] == 1  # "b" still holds the original
    assert len(pool.free) == 3 and filler


def test_no_room_for_copies_means_no_compaction_this_step():
    pool = FakePool(8)
    row = request(pool, 7)
    pool.touch([row[0], row[2]])
    assert decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=1) is None
    assert decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=0) is None
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=2)
    assert d.copy_rows == (0, 2) and d.release_ids == (row[0], row[2])


def test_dst_row_refuses_new_blocks_that_are_sources_or_miscounted():
    pool = FakePool(10)
    row = request(pool, 7)
    pool.touch([row[1]])
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=3)
    assert d.dst_block_ids([9]) == (row[0], 9, row[2], row[3])
    with pytest.raises(ValueError, match="in place"):
        d.dst_block_ids([row[6]])  # a freed tail block: still holds kept tokens
    with pytest.raises(ValueError, match="need as many"):
        d.dst_block_ids([8, 9])


# --- prefix-cached blocks ----------------------------------------------------------

def test_cached_block_held_only_by_us_is_copied_when_the_pool_can_spare_it():
    pool = FakePool(12)
    row = request(pool, 7)
    pool.cached.update(row[:2])  # the prompt's first blocks are in the prefix cache
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=len(pool.free))
    assert d.copy_rows == (0, 1) and d.uncache_ids == ()
    src = list(row)
    apply(pool, row, d)
    assert set(src[:2]) <= pool.cached and set(src[:2]) <= set(pool.free)  # still a hit


def test_cached_block_leaves_the_cache_when_the_pool_is_full():
    pool = FakePool(8)
    row = request(pool, 7)
    pool.cached.update(row[:2])
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=1)  # copies need 2
    assert d.copy_rows == () and d.uncache_ids == tuple(row[:2]) and d.num_new_blocks == 0
    src = list(row)
    assert apply(pool, row, d) == tuple(src[:4])  # compacted in place
    assert not pool.cached & set(src[:2])


def test_shared_blocks_are_copied_and_cached_ones_uncached_when_only_shared_fit():
    pool = FakePool(10)
    row = request(pool, 7)
    pool.touch([row[3]])
    pool.cached.update([row[0], row[3]])  # row[3]: shared and cached (another's hit)
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=1)
    assert d.copy_rows == (3,) and d.uncache_ids == (row[0],)
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=2)
    assert d.copy_rows == (0, 3) and d.uncache_ids == ()


def test_cached_tail_blocks_are_just_freed():
    pool = FakePool(10)
    row = request(pool, 7)
    pool.cached.update(row[4:6])
    d = decide_blocks(pool.view(row), 7 * BS, 4 * BS, BS, num_free=3)
    assert d.uncache_ids == () and d.copy_rows == () and d.blocks_freed == 3
    apply(pool, list(row), d)
    assert pool.free[-2:] == row[4:6][::-1]  # cached blocks queue last, still hits


# --- prompt modules ----------------------------------------------------------------

def test_module_pinned_blocks_are_copied_like_shared_ones():
    """An importer's first blocks are the store's pinned blocks (ref_cnt: the
    pin + each importer): compaction copies them, the pin keeps the originals."""
    pool = FakePool(16)
    module = request(pool, 2 * 1)  # an encode request's 2 full blocks...
    pool.touch(module)  # ...pinned by the store,
    pool.release(module)  # then the encode request finishes
    pool.touch(module)  # an importer adopts them as its first blocks
    row = module + request(pool, 5)
    state = RequestState(num_blocks=7, logical=7 * BS, evicted=0)
    d = plan_blocks(CFG, state, pool.view(row), PoolView(num_free=len(pool.free)), BS)
    assert d.copy_rows == (0, 1) and d.release_ids == tuple(module)
    apply(pool, row, d)
    assert all(pool.ref[b] == 1 for b in module)  # only the pin holds them now
    assert not set(module) & set(row)


def test_module_pins_and_imports():
    assert module_pin_blocks(num_computed=70, num_prompt=50, block_size=BS) == 3
    assert module_pin_blocks(num_computed=40, num_prompt=50, block_size=BS) == 2
    entries = {"s/a": ((1,) * 32, tuple(range(32))), "s/b": ((2,) * 16, tuple(range(40, 56)))}
    ids, pos = [1] * 32 + [2] * 16 + [3] * 8, list(range(32)) + list(range(40, 56)) + [60] * 8
    assert module_imports([("s/a", 32), ("s/b", 16)], ids, pos, entries, BS) == (
        [("s/a", 2), ("s/b", 1)], 48, True)
    # a prefix of a module, a wrong position, a missing entry, a partial block
    assert module_imports([("s/a", 16)], ids, pos, entries, BS) == ([("s/a", 1)], 16, True)
    assert module_imports([("s/a", 32), ("s/b", 16)], ids, pos[:40] + [0] * 16, entries, BS) \
        == ([("s/a", 2)], 32, False)
    assert module_imports([("s/x", 16)], ids, pos, entries, BS) == ([], 0, False)
    assert module_imports([("s/a", 24)], ids, pos, entries, BS) == ([], 0, False)
    # vLLM computes at least the last token: a hit covering all of it gives a block back
    assert trim_hit(48, num_tokens=56, block_size=BS) == 48
    assert trim_hit(48, num_tokens=48, block_size=BS) == 32


def test_a_module_encode_is_never_compacted():
    """request_config (spec.py) runs a request that pins a module under policy
    "none": it is encoded whole, once."""
    pin = EvictionConfig.from_dict({"kv_eviction": "none"})
    state = RequestState(num_blocks=40, logical=40 * BS, evicted=0)
    assert compaction_point(pin, state, PoolView(num_free=0), BS) is None


# --- prefill: room for the next chunk and the cap ----------------------------------

def test_prefill_compacts_between_chunks_only_when_the_pool_is_short():
    state = RequestState(num_blocks=6, logical=6 * BS, evicted=0, num_prompt_tokens=20 * BS)
    # next chunk 4 blocks (chunk 64), 2 other requests want a block each
    assert room_for_next_chunk(6, 6 * BS, 14 * BS, BS, 4 * BS, num_free=6, other_requests=2)
    assert not room_for_next_chunk(6, 6 * BS, 14 * BS, BS, 4 * BS, num_free=5, other_requests=2)
    room, short = PoolView(6, 2, 4 * BS), PoolView(5, 2, 4 * BS)
    assert compaction_point(CFG, state, room, BS) is None
    assert compaction_point(CFG, state, short, BS) == 4 * BS
    # the chunk is at most what is left of the prompt; no chunk size: all of it
    last = RequestState(num_blocks=6, logical=6 * BS, evicted=0, num_prompt_tokens=7 * BS)
    assert compaction_point(CFG, last, PoolView(1, 0, 4 * BS), BS) is None
    assert compaction_point(CFG, state, PoolView(13, 0, None), BS) == 4 * BS
    assert compaction_point(CFG, state, PoolView(14, 0, None), BS) is None
    # past --kv-prefill-cap: compacted between chunks whatever the room
    capped = EvictionConfig.from_dict({"kv_eviction": "streaming", "kv_budget": 5 * BS,
                                       "kv_prefill_cap": 5 * BS})
    assert compaction_point(capped, state, PoolView(100), BS) == 4 * BS
    # a prompt under the budget is never compacted between chunks
    small = RequestState(num_blocks=5, logical=5 * BS, evicted=0, num_prompt_tokens=20 * BS)
    assert compaction_point(CFG, small, short, BS) is None


# --- impossible inputs -------------------------------------------------------------

@pytest.mark.parametrize("row,physical,target,free,match", [
    ([Block(1), Block(2)], 3 * BS, BS, 0, "cannot hold"),
    ([Block(1), Block(1), Block(3)], 3 * BS, BS, 0, "twice"),
    ([Block(1, ref_cnt=0), Block(2)], 2 * BS, BS, 0, "ref_cnt"),
    ([Block(1), Block(2)], 2 * BS, 2 * BS, 0, "target"),
    ([Block(1), Block(2)], 2 * BS, -1, 0, "target"),
    ([Block(1), Block(2)], 2 * BS, BS, -1, "free"),
])
def test_impossible_rows_are_refused(row, physical, target, free, match):
    with pytest.raises(ValueError, match=match):
        decide_blocks(row, physical, target, BS, free)


def test_impossible_states_are_refused():
    with pytest.raises(ValueError, match="evicted"):
        compaction_point(CFG, RequestState(num_blocks=2, logical=10, evicted=11), PoolView(0), BS)
    with pytest.raises(ValueError, match="row of"):
        plan_blocks(CFG, RequestState(num_blocks=3, logical=7 * BS, evicted=0),
                    [Block(1), Block(2)], PoolView(0), BS)
    with pytest.raises(ValueError, match="block size"):
        decide_blocks([Block(1)], 1, 0, 0, 0)


# --- invariants on random rows -----------------------------------------------------

def test_random_rows_keep_the_pool_consistent_and_never_write_a_shared_block():
    rng = random.Random(0)
    for _ in range(300):
        pool = FakePool(40)
        n = rng.randint(2, 12)
        row = request(pool, n)
        for b in row:
            if rng.random() < 0.3:
                pool.touch([b])  # another holder
            if rng.random() < 0.3:
                pool.cached.add(b)
        pool.alloc(rng.randint(0, len(pool.free)))  # others take part of the pool
        physical = rng.randint((n - 1) * BS + 1, n * BS)
        target = rng.randint(0, physical - 1)
        before = pool.view(row)
        d = decide_blocks(before, physical, target, BS, len(pool.free))
        if d is None:
            assert sum(b.shared for b in before[:-(-target // BS)]) > len(pool.free)
            continue
        refs = sum(pool.ref.values())
        src = list(row)
        dst = apply(pool, row, d)
        assert sum(pool.ref.values()) == refs - len(d.free_ids)  # copies swap one for one
        assert list(dst) == row and len(dst) == -(-target // BS)
        for i, (s, b) in enumerate(zip(src, dst)):
            assert b == s or b not in src  # in-place precondition
            if b == s:  # written in place: only we hold it, and it is out of the cache
                assert pool.ref[b] == 1 and b not in pool.cached, (i, before)
        assert len(set(pool.free)) == len(pool.free) == sum(r == 0 for r in pool.ref.values())
