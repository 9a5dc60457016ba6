"""The last `size` queries of every request, per layer: snapkv/andpro's window.

SnapKV and AnDPro score the cache with the queries of the latest tokens (the
observation window). The attention backend sees each token's query once, in
the step that computes it, so every step copies the queries of each request's
newest tokens (at most `size` per request) into a ring; at a compaction the
worker reads the request's window back in token order.

    queries[layer]: (capacity, ring, H_q, D) query dtype (query_buffers.py),
                    ring = size + spare
    the token at logical position p of the request in row r sits at [r, p % ring]
    end[req]:   logical position one past the newest logged token
    count[req]: tokens logged since the ring row was (re)started, capped at ring
    tail[req]:  newest tokens known to sit, in order, at the end of the
                request's resident cache: new tokens add to it, a compaction
                cuts it to the recent part it kept. The window is the newest
                min(count, tail) tokens, so each query sees exactly the
                resident tokens before it (its causal prefix as cached).

Queries are post-RoPE, like the cached keys, so a score computed later equals
the one the window's own forward pass would have given against the same keys.
A gap in the logged positions (a prefix-cache hit, a re-prefill after
preemption) restarts the row: the window is always the latest `count` tokens.

Speculative decoding logs a step's draft tokens with its token; the rejected
ones are rolled back before the window is read (`roll_back`). They were
written over the ring's oldest cells, so the ring keeps `spare` cells (the
most drafts a step has) beyond the window: the `size` newest accepted
queries always survive a rollback.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm_kvevict.core.scoring.decode_log import StepPlacement, free_row
from vllm_kvevict.core.scoring.query_buffers import QueryBuffers


class QueryWindow:
    def __init__(self, size: int, spare: int = 0) -> None:
        self.size = size
        self.ring = size + spare
        self.row_of: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.tail: dict[str, int] = {}
        self.capacity = 0
        self.queries = QueryBuffers(self.ring)

    def _row(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is None:
            row = free_row(self.row_of)
            self.capacity = max(self.capacity, row + 1)
            self.row_of[req_id] = row
            self.count[req_id] = 0
            self.end[req_id] = 0
            self.tail[req_id] = 0
        return row

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            if self.row_of.pop(req_id, None) is not None:
                del self.count[req_id], self.end[req_id], self.tail[req_id]

    def roll_back(self, req_id: str, num: int) -> None:
        """Forget the request's `num` newest queries (speculative decoding's
        rejected drafts): the next step logs their positions again."""
        if req_id in self.end:
            self.end[req_id] -= num
            self.count[req_id] = max(0, self.count[req_id] - num)
            self.tail[req_id] = max(0, self.tail[req_id] - num)

    def compacted(self, req_id: str, recent: int) -> None:
        """The request kept only its `recent` newest tokens in order at the end."""
        if req_id in self.tail:
            self.tail[req_id] = min(self.tail[req_id], recent)

    # --- once per step ---------------------------------------------------------

    def place(self, req_ids: list[str], q_lens: list[int], seq_lens: list[int],
              scored: list[bool] | None = None) -> StepPlacement:
        """Ring cells for the newest min(q_len, ring) tokens of each scored row.

        q_lens: new tokens per row; seq_lens: logical lengths after this step.
        """
        tokens, cells = [], []
        start = 0
        scored = scored or [True] * len(req_ids)
        for req_id, n, s, keep in zip(req_ids, q_lens, seq_lens, scored):
            if keep and n > 0:
                row = self._row(req_id)
                if self.end[req_id] != s - n:  # not contiguous with what is logged
                    self.count[req_id] = self.tail[req_id] = 0
                k = min(n, self.ring)
                for p in range(s - k, s):
                    tokens.append(start + n - (s - p))
                    cells.append(row * self.ring + p % self.ring)
                self.count[req_id] = min(self.ring, self.count[req_id] + k)
                self.tail[req_id] += n
                self.end[req_id] = s
            start += n
        as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return StepPlacement(as_long(tokens), as_long(cells))

    # --- per layer -------------------------------------------------------------

    def record(self, layer: str, query: torch.Tensor, placement: StepPlacement,
               scale: float) -> None:
        """query: (num_tokens, H_q, D) of this step."""
        self.queries.hold(layer, query, placement, self.capacity, scale)

    # --- at a compaction -------------------------------------------------------

    def window_len(self, req_id: str, logical_len: int) -> int:
        """How many queries `window` gives for the request (0: none)."""
        if self.row_of.get(req_id) is None or self.end[req_id] != logical_len:
            return 0
        return min(self.count[req_id], self.tail[req_id], self.size)

    def window(self, req_id: str, layers: list[str], logical_len: int
               ) -> tuple[torch.Tensor, float] | None:
        """(L, k, H_q, D) queries of the request's newest k tokens, oldest first,
        for `layers`, and the attention scale; None unless the ring holds the
        tokens right before `logical_len` (the compaction's logical length)."""
        return self.windows([req_id], layers, [logical_len])

    def windows(self, req_ids: list[str], layers: list[str], logical_lens: list[int]
                ) -> tuple[torch.Tensor, float] | None:
        """`window` of requests compacted together: (P * L, k, H_q, D), row
        p * L + l layer l of req_ids[p], one index per layer for all P; None
        unless every request's ring holds the same k > 0 tokens."""
        ks = {self.window_len(r, n) for r, n in zip(req_ids, logical_lens)}
        k = ks.pop()
        if ks or k == 0 or not self.queries.has(layers):
            return None
        rows = torch.tensor([self.row_of[r] for r in req_ids])[:, None]  # (P, 1)
        cols = (torch.tensor(logical_lens)[:, None] - k + torch.arange(k)) % self.ring  # (P, k)
        return self.queries.gather(layers, rows * self.ring + cols), self.queries.scale[layers[0]]
