"""The host tier of InfiniGen offload, and its decode attention. vLLM-free.

When a request compacts (planner.py), the tokens its resident policy drops go
here instead of being lost. Compaction evicts the same number E of tokens from
every (layer, KV head), so a request's host entries are numbered the same way
everywhere: entry j of layer l, head h is the j-th token that head evicted.

Storage (``HostTier``):
  data         blocks of a :class:`~vllm_kvevict.host_pool.HostKVPool`, keyed
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

Decode, per layer and batch row, from the paper (sections 4.2-4.3):
  1. partial logits q~[:C] . k~[:C] * scale of every token, resident and host;
  2. count, per query head, the tokens above max - alpha; the mean count over
     the heads, rounded up, is k for every head, capped at ``cap`` tokens;
  3. each query head's top-k tokens; the host ones among them are fetched;
  4. attention over the resident tokens + the fetched host entries.
``speculate`` runs steps 1-3 with the paper's predicted query (layer i-1's
attention input times layer i's W_Q) and fetches ahead of the layer;
``decode_attention`` runs them again with the layer's own query, takes what
speculation already holds and fetches the rest on demand. The second pass is
our change: on SmolLM2-135M the predicted query alone costs most of the
quality (results/infinigen/dense.md: perplexity 81.9 vs 45.7 with the own
query, full cache 44.0), so speculation decides what moves early and the own
query decides what is attended.
With alpha large and no cap every host entry comes back: attention is then
over all tokens, and decoding equals a run that never offloaded.
``infinigen_decode_reference`` is the same rule written for one row over the
dense cache; tests hold the batched path to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_kvevict.host_pool import HostKVPool
from vllm_kvevict.skewing import skew_keys, skew_queries


# ---------------------------------------------------------------------------
# Decode math
# ---------------------------------------------------------------------------

def partial_logits(qp: torch.Tensor, kp: torch.Tensor, scale: float) -> torch.Tensor:
    """qp (R, H_q, C) . kp (R, H, N, C) -> (R, H_q, N) float32, GQA by head groups."""
    r, hq, c = qp.shape
    h, n = kp.shape[1], kp.shape[2]
    return torch.matmul(qp.float().view(r, h, hq // h, c),
                        kp.float().transpose(2, 3)).view(r, hq, n) * scale


def select_host_entries(logits_res: torch.Tensor, logits_host: torch.Tensor,
                        cap: torch.Tensor, alpha: float) -> torch.Tensor:
    """Which host entries each query head needs (steps 2-3 above).

    logits_res: (R, H_q, S) partial logits of the resident tokens, -inf on padding
    logits_host:(R, H_q, N) partial logits of the host entries, -inf on padding
    cap:        (R,) most tokens (resident + host) one head may select
    returns     (R, H_q, K) int64 host entry indices, -1 where none
    """
    s = logits_res.shape[2]
    logits = torch.cat([logits_res, logits_host], dim=2)
    top = logits.max(dim=2, keepdim=True).values
    counts = (logits > top - alpha).sum(dim=2).float().mean(dim=1).ceil().long()  # (R,)
    total = torch.isfinite(logits[:, 0]).sum(dim=1)
    k = torch.minimum(torch.minimum(counts, cap.long()), total).clamp(min=1)
    kmax = int(k.max()) if k.numel() else 0
    idx = logits.topk(kmax, dim=2).indices  # (R, H_q, kmax), best first
    keep = torch.arange(kmax)[None, None] < k[:, None, None]
    return torch.where(keep & (idx >= s), idx - s, torch.full_like(idx, -1))


def _padding_mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """(R,) lengths -> (R, 1, n) True on padding."""
    return ~(torch.arange(n)[None] < lengths[:, None])[:, None]


def attend_resident_and_host(q: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor,
                             res_len: torch.Tensor, k_host: torch.Tensor,
                             v_host: torch.Tensor, host_mask: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Softmax attention of one decode query per row over its resident tokens
    and its own fetched host entries.

    q: (R, H_q, D); k_res, v_res: (R, H, S, D) with res_len (R,) valid;
    k_host, v_host: (R, H_q, K, D) per query head; host_mask: (R, H_q, K) bool.
    returns (R, H_q, D) float32
    """
    r, hq, d = q.shape
    h, s = k_res.shape[1], k_res.shape[2]
    g = hq // h
    qf = q.float()
    lr = torch.matmul(qf.view(r, h, g, d), k_res.float().transpose(2, 3)).view(r, hq, s)
    lr = lr.masked_fill(_padding_mask(res_len, s), -math.inf)
    lh = (k_host.float() @ qf[..., None])[..., 0]  # (R, H_q, K)
    lh = lh.masked_fill(~host_mask, -math.inf)
    p = (torch.cat([lr, lh], dim=2) * scale).softmax(dim=2)
    out = torch.matmul(p[..., :s].view(r, h, g, s), v_res.float()).view(r, hq, d)
    return out + (p[..., s:, None] * v_host.float()).sum(dim=2)


def select_entries(tier: "HostTier", req_ids: list[str], layer: int, q: torch.Tensor,
                   k_res: torch.Tensor, res_len: torch.Tensor, alpha: float,
                   cap: torch.Tensor, scale: float) -> torch.Tensor:
    """Steps 1-3 for R decode rows of one layer: which host entries to attend.

    q: (R, H_q, D) post-RoPE queries (the layer's own, or predicted from layer
    i-1's input); k_res: (R, H, S, D) the resident keys, res_len (R,) valid;
    cap: (R,) tokens. returns (R, H_q, K) host entry indices, -1 where none.

    The resident partial logits use q~_C . k~_C = q (A_C A_C^T) k^T: one
    (D x D) product per query head instead of skewing every resident key.
    """
    hq = q.shape[1]
    g = hq // k_res.shape[1]
    a = tier.a[layer]  # (H, D, D) packed: the partial channels are the first C
    a_c = a[:, :, :tier.c].repeat_interleave(g, dim=0)  # (H_q, D, C)
    qp = (q.float()[:, :, None, :] @ a_c)[:, :, 0]  # (R, H_q, C)
    qm = (qp[:, :, None, :] @ a_c.transpose(1, 2))[:, :, 0]  # q A_C A_C^T, (R, H_q, D)
    lr = partial_logits(qm, k_res, scale).masked_fill(_padding_mask(res_len, k_res.shape[2]),
                                                      -math.inf)
    kp_host, valid = tier.partial_keys(req_ids, layer)
    lh = partial_logits(qp, kp_host, scale).masked_fill(~valid[:, None], -math.inf)
    return select_host_entries(lr, lh, cap, alpha)


@dataclass
class Fetched:
    """Host entries brought back for R rows: sel (R, H_q, K) entry indices (-1:
    none), k, v (R, H_q, K, D), mask (R, H_q, K) True where present."""

    sel: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor


def take_prefetched(sel: torch.Tensor, pre: Fetched) -> Fetched:
    """The entries of sel (R, H_q, K) that pre already holds (same rows)."""
    r, hq, kp = pre.sel.shape
    n = max(int(sel.max()), int(pre.sel.max())) + 1 if sel.numel() and kp else 0
    # where[r, h, e]: e's position in pre's row (r, h), -1 if pre lacks it
    where = torch.full((r, hq, n + 1), -1, dtype=torch.int64)
    src = torch.where(pre.mask, pre.sel, n)  # absent entries land in the spare slot n
    where.scatter_(2, src, torch.arange(kp).expand(r, hq, kp).contiguous())
    where[..., n] = -1
    at = where.gather(2, torch.where(sel >= 0, sel, n))  # (R, H_q, K)
    hit = at >= 0
    idx = at.clamp(min=0)[..., None].expand(-1, -1, -1, pre.k.shape[-1])
    return Fetched(torch.where(hit, sel, -1), pre.k.gather(2, idx), pre.v.gather(2, idx), hit)


def decode_attention(tier: "HostTier", req_ids: list[str], layer: int, q: torch.Tensor,
                     k_res: torch.Tensor, v_res: torch.Tensor, res_len: torch.Tensor,
                     alpha: float, cap: torch.Tensor, scale: float,
                     prefetched: Fetched | None = None) -> torch.Tensor:
    """Steps 1-4 for R decode rows of one layer, every row with host entries.

    q: (R, H_q, D) post-RoPE queries; k_res, v_res: (R, H, S, D) the resident
    cache (res_len (R,) valid, the current token included); cap: (R,) tokens;
    prefetched: what speculation already brought back for these rows. Entries
    the layer's own query selects come from there when present (a speculation
    hit) and from the host tier otherwise (on demand), so the output never
    depends on how good the speculation was.
    returns (R, H_q, D) float32
    """
    g = q.shape[1] // k_res.shape[1]
    sel = select_entries(tier, req_ids, layer, q, k_res, res_len, alpha, cap, scale)
    stats = tier.stats
    if prefetched is not None:
        stats.prefetch_needed += int((sel >= 0).sum())
        hit = take_prefetched(sel, prefetched)
        stats.speculation_hits += int(hit.mask.sum())
        sel = torch.where(hit.mask, -1, sel)
    k_host, v_host, mask = tier.fetch(req_ids, layer, sel, g)
    if prefetched is not None:
        k_host = torch.where(hit.mask[..., None], hit.k, k_host)
        v_host = torch.where(hit.mask[..., None], hit.v, v_host)
        mask = mask | hit.mask
    stats.attended_tokens += int(res_len.sum()) * q.shape[1] + int(mask.sum())
    stats.decode_rows += q.shape[0]
    return attend_resident_and_host(q, k_res, v_res, res_len, k_host, v_host, mask, scale)


def speculate(tier: "HostTier", req_ids: list[str], layer: int, q: torch.Tensor,
              k_res: torch.Tensor, res_len: torch.Tensor, alpha: float, cap: torch.Tensor,
              scale: float) -> Fetched:
    """InfiniGen's prefetch (section 4.3): select with a predicted query and
    bring those entries back ahead of the layer. Arguments as select_entries."""
    g = q.shape[1] // k_res.shape[1]
    sel = select_entries(tier, req_ids, layer, q, k_res, res_len, alpha, cap, scale)
    k, v, mask = tier.fetch(req_ids, layer, sel, g)
    tier.stats.entries_speculated += int(mask.sum())
    return Fetched(sel, k, v, mask)


def infinigen_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               resident: torch.Tensor, a: torch.Tensor, num_partial: int,
                               alpha: float, cap: int, scale: float) -> torch.Tensor:
    """InfiniGen's decode attention for one query over a dense cache, plainly.

    q: (H_q, D) post-RoPE query; k, v: (H, N, D) every token of the request;
    resident: (H, N) bool, the tokens still on the device (the others are in
    the host tier, all of them present); a: (H, D, D) packed skewing.
    Per query head: partial logits of all N tokens; count those above its max
    - alpha; k = ceil(mean count over heads), at most cap; the head attends its
    resident tokens and those of its top-k that are not resident.
    returns (H_q, D) float32
    """
    hq, d = q.shape
    h, n, _ = k.shape
    g = hq // h
    qp = skew_queries(q.float()[:, None, :], a.float())[:, 0, :num_partial]  # (H_q, C)
    kp = skew_keys(k.float(), a.float())[..., :num_partial]  # (H, N, C)
    out = torch.empty(hq, d)
    logits = [qp[head] @ kp[head // g].T * scale for head in range(hq)]
    counts = [int((lg > lg.max() - alpha).sum()) for lg in logits]
    kk = max(1, min(math.ceil(sum(counts) / hq), cap, n))
    for head in range(hq):
        kv = head // g
        seen = resident[kv].clone()
        seen[logits[head].topk(kk).indices] = True
        w = ((k[kv, seen].float() @ q[head].float()) * scale).softmax(0)
        out[head] = w @ v[kv, seen].float()
    return out


# ---------------------------------------------------------------------------
# The host tier
# ---------------------------------------------------------------------------

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
