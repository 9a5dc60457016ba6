"""The host KV block pool (vllm_kvevict.core.offload.host_pool): victim policies on
hand-made access traces, capacity, request free, data slots, byte accounting."""
import random

import pytest
import torch

from vllm_kvevict.core.offload.host_pool import CounterPolicy, HostKVPool, replay


def k(block, layer=1, req="r"):
    return (req, layer, block)


def fill(pool, blocks, req="r"):
    evicted = []
    for b in blocks:
        evicted += pool.insert(k(b, req=req))
    return evicted


@pytest.mark.parametrize("policy", ["counter", "lru", "fifo"])
def test_capacity_never_exceeded_on_a_random_trace(policy):
    rng = random.Random(0)
    pool = HostKVPool(7, policy, block_bytes=100)
    inserted = 0
    for step in range(2000):
        if rng.random() < 0.3:
            pool.insert(k(rng.randrange(40), layer=rng.randrange(3), req=rng.randrange(3)))
            inserted += 1
        else:
            pool.prefetch([k(rng.randrange(40), layer=rng.randrange(3), req=rng.randrange(3))
                           for _ in range(rng.randrange(1, 6))])
        if rng.random() < 0.01:
            pool.free_request(rng.randrange(3))
        assert len(pool) <= 7
        assert pool.bytes_used == 100 * len(pool) <= pool.bytes_capacity
        assert len(set(pool.slot_of(key) for key in pool.keys())) == len(pool)  # distinct slots
    st = pool.stats
    assert st.peak_blocks == 7 and st.evictions > 0 and st.inserts == inserted
    assert st.bytes_out == 100 * st.prefetch_hits


def test_fifo_evicts_the_oldest_insertion_whatever_the_hits():
    pool = HostKVPool(3, "fifo")
    fill(pool, [0, 1, 2])
    pool.prefetch([k(0)] * 1 + [k(0)])
    pool.prefetch([k(0)])
    assert pool.insert(k(3)) == [k(0)]
    assert pool.insert(k(4)) == [k(1)]
    assert set(pool.keys()) == {k(2), k(3), k(4)}


def test_lru_keeps_what_was_prefetched_recently():
    pool = HostKVPool(3, "lru")
    fill(pool, [0, 1, 2])
    pool.prefetch([k(0)])          # order now 1, 2, 0
    assert pool.insert(k(3)) == [k(1)]
    pool.prefetch([k(2), k(3)])    # order 0, 2, 3
    assert pool.insert(k(4)) == [k(0)]


def test_counter_evicts_the_fewest_hits_oldest_first_on_ties():
    pool = HostKVPool(3, "counter")
    fill(pool, [0, 1, 2])
    for _ in range(3):
        pool.prefetch([k(0)])
    pool.prefetch([k(1)])
    pool.prefetch([k(1)])
    pool.prefetch([k(2)])          # counts 3, 2, 1; 2 is the most recent hit
    assert pool.insert(k(3)) == [k(2)]   # LRU would drop 0 here
    assert pool.insert(k(4)) == [k(3)]   # new block, count 0
    assert pool.policy.count == {k(0): 3, k(1): 2, k(4): 0}
    pool.prefetch([k(4)])
    pool.prefetch([k(4)])          # a tie 2 / 2 with block 1, which is older
    assert pool.insert(k(5)) == [k(1)]


def test_lru_and_counter_differ_on_the_same_trace():
    trace = [("insert", k(0)), ("insert", k(1))] + [("prefetch", [k(0)])] * 3 \
        + [("prefetch", [k(1)]), ("insert", k(2)), ("prefetch", [k(0), k(1), k(2)])]
    lru, counter, fifo = (replay(trace, 2, p) for p in ("lru", "counter", "fifo"))
    # LRU drops 0 (hit longest ago), counter drops 1 (fewer hits), FIFO drops 0
    assert (lru.prefetch_hits, lru.prefetch_misses) == (4 + 2, 1)
    assert (counter.prefetch_hits, counter.prefetch_misses) == (4 + 2, 1)
    pool = HostKVPool(2, "counter")
    for ev in trace[:-1]:
        getattr(pool, ev[0])(ev[1])
    assert set(pool.keys()) == {k(0), k(2)}
    pool = HostKVPool(2, "lru")
    for ev in trace[:-1]:
        getattr(pool, ev[0])(ev[1])
    assert set(pool.keys()) == {k(1), k(2)}
    assert fifo.evictions == 1


def test_counters_halve_when_one_saturates():
    policy = CounterPolicy(bits=2)  # saturates at 3
    pool = HostKVPool(4, policy)
    fill(pool, [0, 1, 2])
    pool.prefetch([k(1)])
    pool.prefetch([k(1)])
    pool.prefetch([k(2)])
    assert policy.count == {k(0): 0, k(1): 2, k(2): 1}
    pool.prefetch([k(1)])          # 1 reaches 3: everyone halves
    assert policy.count == {k(0): 0, k(1): 1, k(2): 0} and policy.halvings == 1
    with pytest.raises(ValueError):
        CounterPolicy(bits=0)


def test_prefetch_counts_hits_misses_and_bytes_once_per_key():
    pool = HostKVPool(2, "counter", block_bytes=4096)
    fill(pool, [0, 1, 2])          # 0 evicted
    res = pool.prefetch([k(1), k(0), k(1), k(2), k(9)])
    assert res.hits == [k(1), k(2)] and res.misses == [k(0), k(9)]
    assert res.slots.tolist() == [pool.slot_of(k(1)), pool.slot_of(k(2))]
    st = pool.stats
    assert (st.prefetch_hits, st.prefetch_misses, st.bytes_out) == (2, 2, 2 * 4096)
    assert st.bytes_in == 3 * 4096 and st.hit_rate == 0.5
    assert pool.policy.count[k(1)] == 1  # a duplicate in one call is one hit


def test_lookup_peeks_without_touching_the_policy():
    pool = HostKVPool(2, "lru")
    fill(pool, [0, 1])
    assert pool.lookup(k(0)) is True and pool.lookup(k(7)) is None
    assert pool.insert(k(2)) == [k(0)]   # the lookup did not refresh 0
    assert (pool.stats.lookups, pool.stats.lookup_hits) == (2, 1)


def test_free_request_drops_every_block_of_it_and_only_it():
    pool = HostKVPool(10, "counter")
    for layer in range(3):
        for b in range(2):
            pool.insert(("a", layer, b))
        pool.insert(("b", layer, 0))
    assert len(pool) == 9
    assert pool.free_request("a") == 6
    assert sorted(pool.keys()) == [("b", 0, 0), ("b", 1, 0), ("b", 2, 0)]
    assert pool.request_keys("a") == set() and pool.free_request("a") == 0
    assert pool.stats.freed == 6
    for i in range(7):                # the freed slots are reused before any eviction
        pool.insert(("c", 0, i))
    assert pool.stats.evictions == 0 and len(pool) == 10
    assert pool.insert(("c", 0, 7)) != []


def test_slab_stores_blocks_and_the_victim_slot_is_overwritten():
    shape = (2, 4, 3, 8)  # K and V of 4 tokens, 3 KV heads, D = 8
    pool = HostKVPool(2, "fifo", block_shape=shape, dtype=torch.float32)
    assert pool.block_bytes == 2 * 4 * 3 * 8 * 4
    blocks = [torch.randn(shape) for _ in range(3)]
    for i, blk in enumerate(blocks[:2]):
        pool.insert(k(i), blk)
    slot0 = pool.slot_of(k(0))
    assert pool.insert(k(2), blocks[2]) == [k(0)]
    assert pool.slot_of(k(2)) == slot0  # the new block took the victim's slot
    res = pool.prefetch([k(2), k(1), k(0)])
    assert torch.equal(pool.slab[res.slots], torch.stack([blocks[2], blocks[1]]))
    assert torch.equal(pool.lookup(k(1)), blocks[1])
    blocks[1].zero_()                    # the pool copied, it does not alias
    assert not torch.equal(pool.lookup(k(1)), blocks[1])
    with pytest.raises(ValueError):
        pool.insert(k(5))                # a data pool needs the data


def test_overwrite_keeps_the_entry_and_evicts_nothing():
    pool = HostKVPool(2, "counter")
    fill(pool, [0, 1])
    pool.prefetch([k(0)])
    assert pool.insert(k(0)) == [] and len(pool) == 2
    assert pool.policy.count[k(0)] == 1 and pool.stats.overwrites == 1


def test_replay_matches_driving_the_pool_and_rejects_unknown_events():
    rng = random.Random(1)
    trace = []
    for t in range(300):
        trace.append(("insert", k(t)))
        trace.append(("prefetch", [k(b) for b in rng.sample(range(t + 1), min(4, t + 1))]))
    trace.append(("free", "r"))
    st = replay(trace, 50, "lru", block_bytes=10)
    pool = HostKVPool(50, "lru", block_bytes=10)
    for ev in trace:
        {"insert": pool.insert, "prefetch": pool.prefetch, "free": pool.free_request}[ev[0]](ev[1])
    assert st.as_dict() == pool.stats.as_dict() and len(pool) == 0
    with pytest.raises(ValueError):
        replay([("bogus", None)], 1, "lru")
    with pytest.raises(ValueError):
        HostKVPool(0)
    with pytest.raises(ValueError):
        HostKVPool(1, "random")


def test_counter_victim_equals_a_scan_of_the_pool_on_a_random_trace():
    """The heap's victim is, at every eviction, the minimum (count, insertion)
    of a full scan (the rule as the paper states it), through hits, halvings,
    frees and re-insertions of the same key."""
    import random

    rng = random.Random(5)
    policy = CounterPolicy(bits=3)  # saturates at 7: many halvings
    resident: set = set()
    for _ in range(5000):
        op = rng.random()
        key = ("r", 0, rng.randrange(40))
        if op < 0.45 and key in resident:
            policy.hit(key)
        elif op < 0.55 and key in resident:
            policy.removed(key)
            resident.discard(key)
        elif key not in resident:
            policy.inserted(key)
            resident.add(key)
        if resident and rng.random() < 0.3:
            want = min(resident, key=lambda k: (policy.count[k], policy._seq[k]))
            assert policy.victim() == want
            policy.removed(want)
            resident.discard(want)
    assert policy.halvings > 10
