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

Storage (``HostTier``):
  data         blocks of a :class:`~vllm_kvevict.core.host_pool.HostKVPool`, keyed
               (request, layer, block); one block is (2, H, BS, D): K and V of
               BS entries per KV head. Each offload starts a fresh block, so
               entry j is block j // BS, offset j % BS; slots past E in the
               last block are padding (``valid`` False). When the pool is full
               its victim policy (counter / LRU / FIFO) drops a block: those
               entries are gone, and selecting one later is a miss.
  partial keys (L, H, n, C) float32 per request, the paper's partial key cache:
               the first C channels of the skewed keys (skewing.py, packed),
               kept beside the resident cache so speculation never reads the
               host tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.core.host_pool import HostKVPool


@dataclass
class TransferStats:
    """Traffic of the host tier since creation, token-granular."""

    entries_offloaded: int = 0   # (layer, head, token) entries written to the host
    entries_fetched: int = 0     # (layer, KV head, token) entries brought back
    entries_missed: int = 0      # selected entries whose block the pool had dropped
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


@dataclass
class _Request:
    valid: torch.Tensor                 # (n,) bool: an entry, not block padding
    partial: torch.Tensor               # (L, H, n, C) float32 partial skewed keys
    blocks: int = 0                     # host blocks per layer


class HostTier:
    """Host entries of every offloading request of one worker.

    a: (L, H, D, D) packed skewing of this worker's KV heads; C partial channels.
    capacity: host blocks in the pool (all layers together).
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
        self.entry_bytes = 2 * d * self.pool.slab.element_size()  # K + V of one head
        self.requests: dict[str, _Request] = {}
        self.stats = TransferStats()
        # partial_keys per (layer, rows): speculation and decode of one layer
        # ask for the same rows; any offload or free changes the answer.
        self._partial_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def num_entries(self, req_id: str) -> int:
        st = self.requests.get(req_id)
        return 0 if st is None else int(st.valid.sum())

    def offload(self, req_id: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append E evicted entries per (layer, head): k, v (L, H, E, D)."""
        self._partial_cache.clear()
        num_layers, h, e, d = k.shape
        bs = self.block_size
        nblk = -(-e // bs)
        st = self.requests.get(req_id)
        if st is None:
            st = self.requests[req_id] = _Request(
                torch.zeros(0, dtype=torch.bool),
                torch.zeros(num_layers, h, 0, self.c))
        pad = nblk * bs - e
        kpad = torch.nn.functional.pad(k, (0, 0, 0, pad))
        vpad = torch.nn.functional.pad(v, (0, 0, 0, pad))
        data = torch.stack([kpad, vpad], dim=1).view(num_layers, 2, h, nblk, bs, d)
        for layer in range(num_layers):
            for b in range(nblk):
                self.pool.insert((req_id, layer, st.blocks + b), data[layer, :, :, b])
        st.blocks += nblk
        kp = (k.float() @ self.a[:num_layers])[..., :self.c]  # skew_keys per layer
        st.partial = torch.cat([st.partial, torch.nn.functional.pad(kp, (0, 0, 0, pad))], dim=2)
        st.valid = torch.cat([st.valid, torch.arange(nblk * bs) < e])
        self.stats.entries_offloaded += num_layers * h * e
        self.stats.bytes_offloaded += num_layers * h * e * self.entry_bytes

    def fetch(self, req_ids: list[str], layer: int, sel: torch.Tensor,
              group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bring the selected entries of one layer back.

        sel: (R, H_q, K) host entry indices (-1: none); group: query heads per
        KV head. Returns k, v (R, H_q, K, D) and mask (R, H_q, K): False where
        nothing was selected or the pool had dropped the entry's block.
        """
        r, hq, kk = sel.shape
        bs = self.block_size
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
        h, d = slab.shape[2], slab.shape[-1]
        base = (slot.clamp(min=0) * 2 * h + kv_head) * bs + off  # K rows; V is h * bs further
        rows = slab.view(-1, d)
        k = rows.index_select(0, base.flatten()).view(r, hq, kk, d)
        v = rows.index_select(0, (base + h * bs).flatten()).view(r, hq, kk, d)
        # Traffic: one copy per distinct (row, KV head, entry); the query heads
        # of a GQA group share it.
        n = int(sel.max()) + 1 if sel.numel() else 1
        fetched = torch.zeros(r, h, n, dtype=torch.bool)
        missed = torch.zeros(r, h, n, dtype=torch.bool)
        row = torch.arange(r)[:, None, None].expand_as(sel)
        head = kv_head.expand_as(sel)
        fetched[row[mask], head[mask], sel[mask]] = True
        lost = (sel >= 0) & ~mask
        missed[row[lost], head[lost], sel[lost]] = True
        self.stats.entries_fetched += int(fetched.sum())
        self.stats.entries_missed += int(missed.sum())
        self.stats.bytes_fetched += int(fetched.sum()) * self.entry_bytes
        self.stats.fetch_steps += r
        return k, v, mask

    def partial_keys(self, req_ids: list[str], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, H, N, C) partial keys of one layer and (R, N) validity, padded to
        the longest row."""
        key = (layer, tuple(req_ids))
        if key not in self._partial_cache:
            self._partial_cache[key] = self._stack_partial_keys(req_ids, layer)
        return self._partial_cache[key]

    def _stack_partial_keys(self, req_ids: list[str], layer: int):
        n = max(self.requests[r].valid.shape[0] for r in req_ids)
        kp = torch.zeros(len(req_ids), self.num_kv_heads, n, self.c)
        valid = torch.zeros(len(req_ids), n, dtype=torch.bool)
        for i, r in enumerate(req_ids):
            st = self.requests[r]
            m = st.valid.shape[0]
            kp[i, :, :m] = st.partial[layer]
            valid[i, :m] = st.valid
        return kp, valid

    def free(self, req_id: str) -> int:
        """Drop a request's host entries (finished, aborted, preempted)."""
        self._partial_cache.clear()
        self.requests.pop(req_id, None)
        return self.pool.free_request(req_id)
