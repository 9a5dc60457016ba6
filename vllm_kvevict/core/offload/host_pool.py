"""A host (CPU) memory pool of offloaded KV blocks, InfiniGen's "KV cache pool
manager" (Lee et al., OSDI 2024, section 4.4).

Entries are blocks keyed by ``(request, layer, block)``: one layer's keys and
values of ``block_size`` consecutive tokens of one request, the unit vLLM's
paged cache moves. The pool holds at most ``capacity`` blocks (user-set).
Inserting into a full pool first evicts a victim; the new block takes the
victim's slot (the paper: "overwrites the selected victim with the newly
generated key and value"), so slot order is arbitrary. An evicted block is
gone: a later prefetch of it is a miss (its tokens can no longer be attended),
which is why the victim policy matters for accuracy.

Victim policies (:func:`make_victim_policy`):

  counter  the paper's choice. A counter per entry, +1 on each prefetch hit;
           when one reaches ``2**bits - 1`` every counter is halved. The victim
           is the lowest counter (ties: the oldest insertion).
  lru      least recently inserted-or-prefetched.
  fifo     oldest insertion.

Data. With ``block_shape`` the pool owns a slab ``(capacity, *block_shape)``
(optionally pinned) and :meth:`HostKVPool.insert` copies a block into its
slot; :meth:`HostKVPool.prefetch` returns the hit slots as a LongTensor for
one gather (``pool.slab[slots]``, then ``.to(device, non_blocking=True)``).
Without ``block_shape`` it keeps only the bookkeeping (trace simulation) and
``block_bytes`` sets the byte accounting.

Pure Python + torch, no vLLM import.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, fields

import torch

Key = tuple  # (request: Hashable, layer: int, block: int)


# ---------------------------------------------------------------------------
# Victim policies
# ---------------------------------------------------------------------------

class VictimPolicy(ABC):
    """Bookkeeping of one policy over the keys resident in a pool."""

    name = "?"

    @abstractmethod
    def inserted(self, key: Key) -> None:
        """``key`` entered the pool."""

    @abstractmethod
    def hit(self, key: Key) -> None:
        """``key`` was prefetched (it is resident)."""

    @abstractmethod
    def removed(self, key: Key) -> None:
        """``key`` left the pool (evicted or freed)."""

    @abstractmethod
    def victim(self) -> Key:
        """The resident key to evict next (the pool is not empty)."""


class FIFOPolicy(VictimPolicy):
    name = "fifo"

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()

    def inserted(self, key):
        self._order[key] = None

    def hit(self, key):
        pass

    def removed(self, key):
        del self._order[key]

    def victim(self):
        return next(iter(self._order))


class LRUPolicy(FIFOPolicy):
    name = "lru"

    def hit(self, key):
        self._order.move_to_end(key)


class CounterPolicy(VictimPolicy):
    """+1 per prefetch hit; all halved when one saturates at ``2**bits - 1``;
    evict the lowest (ties: oldest insertion).

    The victim comes from a heap of (count, insertion, key) entries in
    O(log n) amortised, not a scan of the pool per eviction: a hit pushes the
    key's new entry and leaves the old one stale (skipped when it surfaces), a
    halving (at most once per ``2**bits - 1`` hits) rebuilds the heap."""

    name = "counter"

    def __init__(self, bits: int = 8) -> None:
        if bits < 1:
            raise ValueError(f"counter bits must be >= 1, got {bits}")
        self.max = (1 << bits) - 1
        self.count: dict = {}
        self._seq: dict = {}
        self._next = 0
        self._heap: list = []  # (count, seq, key); stale where count/seq disagree
        self.halvings = 0

    def _push(self, key) -> None:
        heapq.heappush(self._heap, (self.count[key], self._seq[key], key))

    def _rebuild(self) -> None:
        self._heap = [(c, self._seq[k], k) for k, c in self.count.items()]
        heapq.heapify(self._heap)

    def inserted(self, key):
        self.count[key] = 0
        self._seq[key] = self._next
        self._next += 1
        self._push(key)

    def hit(self, key):
        c = self.count[key] + 1
        self.count[key] = c
        if c >= self.max:
            for k in self.count:
                self.count[k] >>= 1
            self.halvings += 1
            self._rebuild()
        else:
            self._push(key)
            if len(self._heap) > 2 * len(self.count) + 64:  # bound the stale entries
                self._rebuild()

    def removed(self, key):
        del self.count[key]
        del self._seq[key]

    def victim(self):
        heap, count, seq = self._heap, self.count, self._seq
        while True:
            c, s, key = heap[0]
            if count.get(key) == c and seq.get(key) == s:
                return key
            heapq.heappop(heap)  # stale: hit since, or removed


POLICIES = {"counter": CounterPolicy, "lru": LRUPolicy, "fifo": FIFOPolicy}


def make_victim_policy(name: str, **kwargs) -> VictimPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"no victim policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(**kwargs)


# ---------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------

@dataclass
class PoolStats:
    """Counters since creation (or :meth:`HostKVPool.reset_stats`)."""

    inserts: int = 0            # blocks written into the pool (offloaded)
    overwrites: int = 0         # inserts of a key already resident
    evictions: int = 0          # victims dropped to make room
    freed: int = 0              # blocks dropped by free_request
    lookups: int = 0
    lookup_hits: int = 0
    prefetch_calls: int = 0
    prefetch_hits: int = 0      # requested blocks found (moved host -> device)
    prefetch_misses: int = 0    # requested blocks not resident (evicted / never inserted)
    bytes_in: int = 0           # device -> host (inserts)
    bytes_out: int = 0          # host -> device (prefetch hits)
    peak_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / n if n else 1.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        return d


@dataclass
class Prefetch:
    """Result of :meth:`HostKVPool.prefetch`, in request order within each list.

    hits:   keys found;       slots: (len(hits),) int64 slab slots of ``hits``
    misses: keys not resident
    """

    hits: list
    misses: list
    slots: torch.Tensor


class HostKVPool:
    """Host memory pool of KV blocks with a fixed capacity (blocks).

    capacity:    most blocks resident at once (>= 1)
    policy:      "counter" | "lru" | "fifo" or a :class:`VictimPolicy`
    block_shape: shape of one block's data, e.g. (2, block_size, H, D) for a
                 layer's K and V; the pool then allocates a
                 (capacity, *block_shape) slab of ``dtype``. None: bookkeeping only.
    block_bytes: bytes of one block for accounting when ``block_shape`` is None
                 (with a slab: derived from it)
    pin_memory:  pin the slab (faster, async host -> device copies)
    counter_bits: the counter policy's width
    """

    def __init__(self, capacity: int, policy: str | VictimPolicy = "counter", *,
                 block_shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.bfloat16,
                 block_bytes: int = 0, pin_memory: bool = False, counter_bits: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity = int(capacity)
        if isinstance(policy, str):
            policy = make_victim_policy(policy, **({"bits": counter_bits} if policy == "counter" else {}))
        self.policy = policy
        self.slab: torch.Tensor | None = None
        if block_shape is not None:
            self.slab = torch.empty((self.capacity, *block_shape), dtype=dtype,
                                    pin_memory=pin_memory)
            block_bytes = self.slab[0].numel() * self.slab.element_size()
        self.block_bytes = int(block_bytes)
        self._slot: dict = {}                     # key -> slot
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._by_request: dict[Hashable, set] = {}
        self.stats = PoolStats()

    # -- inspection -----------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: Key) -> bool:
        return key in self._slot

    def keys(self) -> list:
        return list(self._slot)

    def slot_of(self, key: Key) -> int | None:
        return self._slot.get(key)

    def request_keys(self, request: Hashable) -> set:
        return set(self._by_request.get(request, ()))

    @property
    def bytes_used(self) -> int:
        return len(self._slot) * self.block_bytes

    @property
    def bytes_capacity(self) -> int:
        return self.capacity * self.block_bytes

    def reset_stats(self) -> None:
        self.stats = PoolStats(peak_blocks=len(self))

    # -- operations -----------------------------------------------------------
    def insert(self, key: Key, data: torch.Tensor | None = None) -> list:
        """Offload block ``key`` (with ``data`` of ``block_shape`` when the
        pool has a slab). Returns the evicted keys ([] or [victim]). A key
        already resident is overwritten in place, keeping its policy state."""
        if self.slab is not None and data is None:
            raise ValueError("this pool stores data: insert(key, data) needs the block")
        evicted = []
        slot = self._slot.get(key)
        if slot is None:
            if not self._free:
                victim = self.policy.victim()
                self._drop(victim)
                self.stats.evictions += 1
                evicted.append(victim)
            slot = self._free.pop()
            self._slot[key] = slot
            self._by_request.setdefault(key[0], set()).add(key)
            self.policy.inserted(key)
        else:
            self.stats.overwrites += 1
        if data is not None and self.slab is not None:
            self.slab[slot].copy_(data)
        self.stats.inserts += 1
        self.stats.bytes_in += self.block_bytes
        self.stats.peak_blocks = max(self.stats.peak_blocks, len(self._slot))
        return evicted

    def lookup(self, key: Key) -> torch.Tensor | bool | None:
        """Peek at ``key`` without moving it or touching the policy: its slab
        block (a view), True for a bookkeeping-only pool, None when absent."""
        self.stats.lookups += 1
        slot = self._slot.get(key)
        if slot is None:
            return None
        self.stats.lookup_hits += 1
        return self.slab[slot] if self.slab is not None else True

    def prefetch(self, keys: Iterable[Key]) -> Prefetch:
        """Account a host -> device fetch of ``keys`` (each at most once per
        call): hits bump the policy (counter +1, LRU touch) and the bytes moved;
        misses are reported. Copy the data with ``pool.slab[result.slots]``."""
        hits, misses, slots = [], [], []
        seen = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            slot = self._slot.get(key)
            if slot is None:
                misses.append(key)
            else:
                hits.append(key)
                slots.append(slot)
                self.policy.hit(key)
        st = self.stats
        st.prefetch_calls += 1
        st.prefetch_hits += len(hits)
        st.prefetch_misses += len(misses)
        st.bytes_out += len(hits) * self.block_bytes
        return Prefetch(hits, misses, torch.tensor(slots, dtype=torch.int64))

    def free_request(self, request: Hashable) -> int:
        """Drop every block of ``request`` (finished or aborted); returns how many."""
        keys = self._by_request.pop(request, set())
        for key in keys:
            self._drop(key, unindex=False)
        self.stats.freed += len(keys)
        return len(keys)

    def _drop(self, key: Key, unindex: bool = True) -> None:
        slot = self._slot.pop(key)
        self._free.append(slot)
        self.policy.removed(key)
        if unindex:
            owned = self._by_request[key[0]]
            owned.discard(key)
            if not owned:
                del self._by_request[key[0]]


# ---------------------------------------------------------------------------
# Trace replay (the paper's Table 2 setting, on a recorded access trace)
# ---------------------------------------------------------------------------

def replay(trace: Iterable[tuple], capacity: int, policy: str | VictimPolicy,
           block_bytes: int = 0, **kwargs) -> PoolStats:
    """Replay a trace on a fresh bookkeeping-only pool and return its stats.

    trace events: ("insert", key) when a block is offloaded, ("prefetch", [keys])
    for one prefetch (one layer of one decode step), ("free", request).
    """
    pool = HostKVPool(capacity, policy, block_bytes=block_bytes, **kwargs)
    for event in trace:
        kind, arg = event[0], event[1]
        if kind == "insert":
            pool.insert(arg)
        elif kind == "prefetch":
            pool.prefetch(arg)
        elif kind == "free":
            pool.free_request(arg)
        else:
            raise ValueError(f"unknown trace event {kind!r}")
    return pool.stats
