"""InfiniGen offload's decode attention over resident + host entries. vLLM-free.

When a request compacts (planner.py), the tokens its resident policy drops go
here instead of being lost. Compaction evicts the same number E of tokens from
every (layer, KV head), so a request's host entries are numbered the same way
everywhere: entry j of layer l, head h is the j-th token that head evicted.

Storage: ``host_tier.HostTier`` (the subsystem's one state object).

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

from vllm_kvevict.core.offload.host_tier import HostTier
from vllm_kvevict.core.offload.skewing import skew_keys, skew_queries

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
    keep = torch.arange(kmax, device=k.device)[None, None] < k[:, None, None]
    return torch.where(keep & (idx >= s), idx - s, torch.full_like(idx, -1))


def _padding_mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """(R,) lengths -> (R, 1, n) True on padding."""
    return ~(torch.arange(n, device=lengths.device)[None] < lengths[:, None])[:, None]


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


def select_entries(tier: HostTier, req_ids: list[str], layer: int, q: torch.Tensor,
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
    where = torch.full((r, hq, n + 1), -1, dtype=torch.int64, device=sel.device)
    src = torch.where(pre.mask, pre.sel, n)  # absent entries land in the spare slot n
    where.scatter_(2, src, torch.arange(kp, device=sel.device).expand(r, hq, kp).contiguous())
    where[..., n] = -1
    at = where.gather(2, torch.where(sel >= 0, sel, n))  # (R, H_q, K)
    hit = at >= 0
    idx = at.clamp(min=0)[..., None].expand(-1, -1, -1, pre.k.shape[-1])
    return Fetched(torch.where(hit, sel, -1), pre.k.gather(2, idx), pre.v.gather(2, idx), hit)


def decode_attention(tier: HostTier, req_ids: list[str], layer: int, q: torch.Tensor,
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


def speculate(tier: HostTier, req_ids: list[str], layer: int, q: torch.Tensor,
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
