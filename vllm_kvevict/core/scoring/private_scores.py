"""H2O score rows of a request's own, where its first blocks are shared.

H2O's accumulated attention lives beside the KV, one float per (KV head, slot)
(`core/scoring/scores.py`). A request that starts with blocks another request may read
(a prefix-cache hit, imported prompt modules: vLLM puts them first in its
block row) must not add its attention into those blocks' slots: the owner, a
later importer, or a stale value from an earlier request would share them.
Such a request instead keeps the scores of its first `n` physical tokens here,
privately:

    rows[req_id][layer]: (H_kv, n) float32, zero at first: a request's scores
                         count the queries it computed, and the cached prefix's
                         own queries were not computed by it

until its first compaction, which copies every kept shared block into a
private one (spec.py), writes these scores beside the kept tokens
(`restore`), and drops the rows: from then on the request's scores live at its
own slots like any other's. vLLM-free.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PrivateScores:
    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}  # req_id -> n: its first n tokens are scored here
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    def open(self, req_id: str, num_tokens: int) -> None:
        self.tokens[req_id] = num_tokens
        self.rows[req_id] = {}

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.tokens.pop(req_id, None)
            self.rows.pop(req_id, None)

    def of(self, req_id: str, layer: str, num_heads: int,
           device: torch.device) -> torch.Tensor | None:
        """(H, n) the request's private scores in `layer` (made on first use), or
        None when its scores all live at its slots."""
        n = self.tokens.get(req_id)
        if n is None:
            return None
        rows = self.rows[req_id]
        row = rows.get(layer)
        if row is None:
            rows[layer] = row = torch.zeros(num_heads, n, dtype=torch.float32, device=device)
        return row

    def batch(self, req_ids: list[str], num_rows: int, layer: str, num_heads: int,
              device: torch.device) -> list[torch.Tensor | None] | None:
        """Per batch row (padded with None to num_rows), the row's private scores
        in `layer`; None when no row has any."""
        rows = [self.of(r, layer, num_heads, device) for r in req_ids]
        rows += [None] * (num_rows - len(rows))
        return rows if any(r is not None for r in rows) else None

    def stacked(self, req_id: str, layers: list[str], num_heads: int,
                device: torch.device) -> torch.Tensor | None:
        """(L, H, n) the private scores of `layers`, in order, or None."""
        if req_id not in self.tokens:
            return None
        return torch.stack([self.of(req_id, name, num_heads, device) for name in layers])


def restore(scores: torch.Tensor, private: torch.Tensor, keep: torch.Tensor,
            after: torch.Tensor, dst_rows: torch.Tensor, block_size: int) -> None:
    """After a compaction, write the private score of every kept token that came
    from the first n positions at the slot the token now occupies.

    scores:   (H, S) float32 the stack's per-slot scores
    private:  (L, H, n) the request's private scores of its first n positions
    keep:     (L, H, new_len) int64 kept indices into the old row (slot order)
    after:    (L, H, new_len) int64 where each kept token now is (0..new_len-1)
    dst_rows: (L, n_dst) int64 the destination blocks, already offset by layer
    """
    dev = scores.device
    keep, after, dst_rows = keep.to(dev), after.to(dev), dst_rows.to(dev)
    layer, head, j = (keep < private.shape[2]).nonzero(as_tuple=True)
    slot = after[layer, head, j]
    column = dst_rows[layer, slot // block_size] * block_size + slot % block_size
    scores[head, column] = private.to(dev)[layer, head, keep[layer, head, j]]
