"""The host tier of InfiniGen offload: one worker's host entries. vLLM-free.

The offload subsystem, end to end (one state object, ``HostTier``, per worker):
  scheduler  planner.py decides compactions; with offload on, what the resident
             policy drops is offloaded rather than lost.
  worker     integration/offload_attention.py makes the worker's HostTier on
             first use (the skewing file, the pool sized by --kv-swap-space),
             offloads a compaction's evicted tokens (``offload``), and per
             decode layer runs ``offload.speculate`` (prefetch ahead of the
             layer) and ``offload.decode_attention`` (fetch the rest, attend).
  connector  integration/offload_connector.py reports the tier's traffic
             (``stats``) to vLLM's KV-connector metrics and frees a finished
             request's entries (``free``).
  pool       host_pool.HostKVPool: fixed-size host blocks with a victim policy.

When a request compacts, the tokens its resident policy drops come here.
Compaction evicts the same number E of tokens from every (layer, KV head), so a
request's host entries are numbered the same way everywhere: entry j of layer
l, head h is the j-th token that head evicted.

Storage (``HostTier``), all preallocated, one slot per pool block:
  data         blocks of a :class:`~vllm_kvevict.core.offload.host_pool.HostKVPool`, keyed
               (request, layer, block); one block is (2, H, BS, D): K and V of
               BS entries per KV head. Each offload starts a fresh block, so
               entry j is block j // BS, offset j % BS; slots past E in the
               last block are padding (``fill`` says how many are entries).
  partial keys ``kp`` (capacity, H, BS, C) float32, the paper's partial key
               cache: slot s holds the first C channels of the skewed keys
               (skewing.py, packed) of the block in pool slot s, so speculation
               never reads the K/V slab. Being per slot, they are bounded by the
               pool and leave with their block.
When the pool is full its victim policy (counter / LRU / FIFO) drops a block,
and its partial keys with it: those entries are gone for that layer. Selection
can no longer score them, so it never picks them (``partial_keys`` marks them
invalid) and chooses among the entries still present instead.
``entries_missed`` therefore counts, per fetch (one per selection: speculation
or decode, per layer and row), every dropped entry of the row and KV head, the
entries that selection could have wanted and could not have; ``entries_dropped``
counts each once, when its block is dropped.

Memory: both slabs come out of --kv-swap-space (``capacity_for``). A slot is
  slot_bytes = 2 * H * BS * D * itemsize(dtype)  +  H * BS * C * 4
and capacity = max(1, swap_bytes // (L * slot_bytes) * L) slots (a multiple of
the layers), so capacity * slot_bytes <= swap_bytes whenever one slot per layer
fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.core.offload.host_pool import HostKVPool


@dataclass
class TransferStats:
    """Traffic of the host tier since creation, token-granular."""

    entries_offloaded: int = 0   # (layer, head, token) entries written to the host
    entries_dropped: int = 0     # of those, lost when the pool dropped their block
    entries_fetched: int = 0     # (layer, KV head, token) entries brought back
    entries_missed: int = 0      # per fetch: dropped entries of its rows (module docstring)
    bytes_offloaded: int = 0
    bytes_fetched: int = 0
    fetch_steps: int = 0         # (layer, row) fetches, speculative or on demand
    decode_rows: int = 0         # (layer, row) attended over resident + host
    # Speculation, per (layer, row, query head, entry), at layers that had a prefetch:
    prefetch_needed: int = 0     # entries the layer's own query selected
    entries_speculated: int = 0  # entries the prefetch brought
    speculation_hits: int = 0    # needed entries the prefetch had brought
    attended_tokens: int = 0     # sum over (layer, row, query head) of tokens attended

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Request:
    """One request's host blocks: block b holds entries b * BS up to b * BS + fill[b]."""

    def __init__(self, num_layers: int) -> None:
        self.fill: list[int] = []  # entries per block, the same at every layer
        self.entries = 0           # sum(fill)
        # Per layer: the pool slot of each block (-1: dropped), mirrored here so
        # partial_keys makes one tensor per row instead of a lookup per block.
        self.slots: list[list[int]] = [[] for _ in range(num_layers)]
        self.lost = [0] * num_layers  # entries per layer whose block was dropped


class HostTier:
    """Host entries of every offloading request of one worker.

    a: (L, H, D, D) packed skewing of this worker's KV heads; C partial channels.
    capacity: host blocks in the pool (all layers together), see ``capacity_for``.
    """

    def __init__(self, capacity: int, victim: str, a: torch.Tensor, num_partial: int,
                 block_size: int, dtype: torch.dtype, pin_memory: bool = False) -> None:
        self.a = a.float()
        self.c = num_partial
        self.block_size = block_size
        num_layers, h, d, _ = a.shape
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, h, d
        self.pool = HostKVPool(capacity, victim, block_shape=(2, h, block_size, d),
                               dtype=dtype, pin_memory=pin_memory)
        # Partial keys of the block in each pool slot. Never pinned: only the
        # host reads them (selection), nothing copies them to the device.
        self.kp = torch.empty(self.pool.capacity, h, block_size, num_partial)
        self.entry_bytes = 2 * d * self.pool.slab.element_size()  # K + V of one head
        self.requests: dict[str, _Request] = {}
        self.stats = TransferStats()
        # partial_keys per (layer, rows): speculation and decode of one layer
        # ask for the same rows; any offload or free changes the answer.
        self._partial_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def capacity_for(swap_bytes: int, num_layers: int, num_kv_heads: int, block_size: int,
                     head_dim: int, num_partial: int, dtype: torch.dtype) -> int:
        """Pool slots whose K/V blocks and partial keys fit in ``swap_bytes``
        (module docstring), a multiple of the layers, at least 1."""
        slot = num_kv_heads * block_size * (2 * head_dim * dtype.itemsize + 4 * num_partial)
        return max(1, swap_bytes // (slot * num_layers) * num_layers)

    @property
    def nbytes(self) -> int:
        """Host bytes of both slabs, fixed at construction."""
        return (self.pool.slab.numel() * self.pool.slab.element_size()
                + self.kp.numel() * self.kp.element_size())

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def num_entries(self, req_id: str) -> int:
        """Entries offloaded per (layer, head) and not freed, dropped ones included."""
        st = self.requests.get(req_id)
        return 0 if st is None else st.entries

    def offload(self, req_id: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append E evicted entries per (layer, head): k, v (L, H, E, D).
        O(E): earlier entries are not touched (unless the pool drops them)."""
        self._partial_cache.clear()
        num_layers, h, e, d = k.shape
        bs = self.block_size
        nblk = -(-e // bs)
        st = self.requests.get(req_id)
        if st is None:
            st = self.requests[req_id] = _Request(self.num_layers)
        first = len(st.fill)
        st.fill += [min(bs, e - j) for j in range(0, e, bs)]
        st.entries += e
        pad = nblk * bs - e
        kpad = torch.nn.functional.pad(k, (0, 0, 0, pad))
        vpad = torch.nn.functional.pad(v, (0, 0, 0, pad))
        data = torch.stack([kpad, vpad], dim=1).view(num_layers, 2, h, nblk, bs, d)
        kp = (kpad.float() @ self.a[:num_layers])[..., :self.c]  # skew_keys per layer
        kp = kp.view(num_layers, h, nblk, bs, self.c)
        for layer in range(num_layers):
            for b in range(nblk):
                key = (req_id, layer, first + b)
                for victim in self.pool.insert(key, data[layer, :, :, b]):
                    self._dropped(victim)
                slot = self.pool.slot_of(key)
                self.kp[slot] = kp[layer, :, b]
                st.slots[layer].append(slot)
        self.stats.entries_offloaded += num_layers * h * e
        self.stats.bytes_offloaded += num_layers * h * e * self.entry_bytes

    def _dropped(self, key: tuple) -> None:
        """The pool's victim policy dropped block ``key``, partial keys and all."""
        st = self.requests[key[0]]  # free() takes a request's blocks with it
        n = st.fill[key[2]]
        st.slots[key[1]][key[2]] = -1
        st.lost[key[1]] += n
        self.stats.entries_dropped += self.num_kv_heads * n

    def fetch(self, req_ids: list[str], layer: int, sel: torch.Tensor,
              group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bring the selected entries of one layer back.

        sel: (R, H_q, K) host entry indices (-1: none); group: query heads per
        KV head. Returns k, v (R, H_q, K, D) and mask (R, H_q, K): False where
        nothing was selected or the pool had dropped the entry's block.
        """
        r, hq, kk = sel.shape
        bs = self.block_size
        h = self.num_kv_heads
        # Counted even when nothing is selected: the dropped entries were not
        # candidates (module docstring).
        self.stats.entries_missed += h * sum(self.requests[i].lost[layer] for i in req_ids)
        chosen = sel >= 0
        if not bool(chosen.any()):  # e.g. speculation already holds everything
            empty = self.pool.slab.new_zeros(r, hq, kk, self.head_dim)
            return empty, empty.clone(), chosen
        block = sel.clamp(min=0) // bs
        nb = int(block.max()) + 1 if sel.numel() else 1
        wanted = torch.zeros(r, nb, dtype=torch.bool)
        wanted[torch.arange(r)[:, None, None].expand_as(sel)[chosen], block[chosen]] = True
        where = torch.full((r, nb), -1, dtype=torch.int64)  # (row, block) -> slab slot
        for i, req_id in enumerate(req_ids):
            blocks = torch.nonzero(wanted[i])[:, 0].tolist()
            got = self.pool.prefetch([(req_id, layer, b) for b in blocks])  # counters, LRU
            if got.hits:
                where[i, [key[2] for key in got.hits]] = got.slots
        slot = torch.where(chosen, where.gather(1, block.view(r, -1)).view_as(sel), -1)
        mask = slot >= 0
        kv_head = (torch.arange(hq) // group)[None, :, None]
        off = sel.clamp(min=0) % bs
        # One index_select per tensor over the slab seen as rows of D:
        # row ((slot * 2 + kv) * H + head) * BS + offset.
        slab = self.pool.slab
        d = slab.shape[-1]
        base = (slot.clamp(min=0) * 2 * h + kv_head) * bs + off  # K rows; V is h * bs further
        rows = slab.view(-1, d)
        k = rows.index_select(0, base.flatten()).view(r, hq, kk, d)
        v = rows.index_select(0, (base + h * bs).flatten()).view(r, hq, kk, d)
        # Traffic: one copy per distinct (row, KV head, entry); the query heads
        # of a GQA group share it.
        n = int(sel.max()) + 1 if sel.numel() else 1
        fetched = torch.zeros(r, h, n, dtype=torch.bool)
        row = torch.arange(r)[:, None, None].expand_as(sel)
        fetched[row[mask], kv_head.expand_as(sel)[mask], sel[mask]] = True
        self.stats.entries_fetched += int(fetched.sum())
        self.stats.bytes_fetched += int(fetched.sum()) * self.entry_bytes
        self.stats.fetch_steps += r
        return k, v, mask

    def partial_keys(self, req_ids: list[str], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, H, N, C) partial keys of one layer and (R, N) validity, padded to
        the longest row. Invalid: block padding, and entries whose block the
        pool dropped at this layer (their partial keys went with it)."""
        key = (layer, tuple(req_ids))
        if key not in self._partial_cache:
            self._partial_cache[key] = self._stack_partial_keys(req_ids, layer)
        return self._partial_cache[key]

    def _stack_partial_keys(self, req_ids: list[str], layer: int):
        r, h, bs = len(req_ids), self.num_kv_heads, self.block_size
        nb = max(len(self.requests[i].fill) for i in req_ids)
        slots = torch.full((r, nb), -1, dtype=torch.int64)  # -1: dropped or past the row
        fill = torch.zeros(r, nb, dtype=torch.int64)
        for i, req_id in enumerate(req_ids):
            st = self.requests[req_id]
            slots[i, :len(st.fill)] = torch.tensor(st.slots[layer], dtype=torch.int64)
            fill[i, :len(st.fill)] = torch.tensor(st.fill, dtype=torch.int64)
        present = slots >= 0
        kp = torch.zeros(r, h, nb, bs, self.c)
        row, block = present.nonzero(as_tuple=True)
        kp[row, :, block] = self.kp[slots[present]]  # (M, H, BS, C), one gather
        valid = torch.arange(bs) < torch.where(present, fill, 0)[..., None]  # (R, nb, BS)
        return kp.view(r, h, nb * bs, self.c), valid.view(r, nb * bs)

    def free(self, req_id: str) -> int:
        """Drop a request's host entries (finished, aborted, preempted)."""
        self._partial_cache.clear()
        self.requests.pop(req_id, None)
        return self.pool.free_request(req_id)
