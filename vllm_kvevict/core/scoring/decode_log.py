"""Decode queries wait here and are scored up to `depth` steps at a time.

Scoring one decode query means gathering all its request's keys (in the CPU
layout, a transposing copy); scoring 16 queries against one gather costs about
as much as scoring one. The default depth, 32, is the demo's block size: a
request compacts once per block of new tokens and its log is flushed then, so
one gather serves the whole block (the demo's h2o scoring: 0.89-0.93 s vs
1.05-1.22 s at depth 16, 1.01 at 24; benchmarks/step_breakdown.py, one core).

The deferral is exact, not an approximation: a request's keys do not move
until it is compacted, and each logged query keeps the physical length it saw,
so the later score equals the per-step one (up to float summation order).

The log is therefore flushed
  - for a request, right before it is compacted (its keys are about to move),
  - for every request, when one of them has `depth` queries waiting,
and dropped for a request whose blocks were freed (finished, aborted,
preempted: its blocks may already hold another request's KV) or that is
prefilled again.

    queries[layer]: (capacity, depth, H_q, D) query dtype (query_buffers.py)
    visible:        (capacity, depth) int64, 0 = empty
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvevict.core.eviction.kernel_dispatch import cpu_copier
from vllm_kvevict.core.scoring.query_buffers import QueryBuffers
from vllm_kvevict.core.scoring.scores import score_queries


# (req_id, layer name, LayerStack holding it) -> the request's private score
# row there, or None
PrivateOf = Callable[[str, str, Any], "torch.Tensor | None"]


@dataclass
class StepPlacement:
    """Where this step's queries go: token index -> (buffer row, column)."""
    tokens: torch.Tensor  # (N,) int64 token indices in the step's query tensor
    cells: torch.Tensor   # (N,) int64 row * columns + column
    # (num_reqs,) bool: rows not scored in the forward: prefill rows a ChunkLog
    # took, to score next step, and decode rows with drafts, logged (H2O)
    deferred: torch.Tensor | None = None
    # Some row is scored in the forward (a prefill chunk neither deferred nor
    # unscored). False: the layers only log queries and zero the new slots.
    score_now: bool = True
    # The compiled CPU kernel's module, whose copy_rows stores the queries of
    # CPU buffers (query_buffers.py), or None (torch): looked up once per step.
    copier: Any = field(default_factory=cpu_copier)

    def defer(self, deferred: torch.Tensor | None, q_lens: list[int],
              scored: list[bool] | None, drafts: list[int] | None = None) -> None:
        """Take the chunk log's rows (ChunkLog.place) and the decode rows with
        speculative drafts (the decode log's), none scored in the forward, and
        decide `score_now`."""
        if drafts and any(drafts):
            drafted = torch.tensor([d > 0 for d in drafts], dtype=torch.bool)
            deferred = drafted if deferred is None else deferred | drafted
        self.deferred = deferred
        self.score_now = any(
            n > 1 and (scored is None or scored[i]) and (deferred is None or not deferred[i])
            for i, n in enumerate(q_lens))


def rows_of(rows: list[int]) -> slice | torch.Tensor:
    """Ascending buffer rows as an index: a slice where they are consecutive
    (every request flushing at once, as in a lockstep batch), so that reading
    the queries is a view, not a gather of every layer's log; else a tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64)


def free_row(row_of: dict[str, int]) -> int:
    """The lowest buffer row no request holds."""
    used = set(row_of.values())
    return next(i for i in range(len(row_of) + 1) if i not in used)


def score_logged(stacks: list, req_ids: list[str], blocks: list[list[int]],
                 visible: torch.Tensor, logged: Callable[[str], bool],
                 queries_of: Callable[[list[str]], torch.Tensor],
                 scale: dict[str, float], private_of: PrivateOf | None = None) -> None:
    """Score logged queries of `req_ids` in every layer: one score_queries call
    per layer stack (per scale), its rows every (layer, request) pair, so the
    per-call work (masks, slot lists, dispatch) is paid once, not per layer.
    Shared by the decode log and the chunk log.

    stacks:     the worker's layer_stack.LayerStacks
    blocks:     each request's block ids (worker's copy)
    visible:    (R, Q) int64 physical keys each query sees, 0 = padding
    logged:     layer name -> whether its queries were logged
    queries_of: L logged layer names -> (L * R, Q, H_q, D) their queries,
                row l * R + r (one read for all L: QueryBuffers.take)
    private_of: (req_id, layer, stack) -> its private score row, or None
    """
    bs = stacks[0].layout.block_size
    nblk = -(-int(visible.max()) // bs)
    block_rows = torch.zeros(len(req_ids), nblk, dtype=torch.int64)
    for i, row in enumerate(blocks):
        row = row[:nblk]
        block_rows[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    for st in stacks:
        groups: dict[float, list[tuple[int, str]]] = {}
        for layer, name in enumerate(st.names):
            if logged(name):
                groups.setdefault(scale[name], []).append((layer, name))
        key_cache, _ = st.layout.split(st.kv_cache)
        for sc, group in groups.items():
            # Layer l's block b is block l * num_blocks + b of the stack.
            offset = torch.tensor([layer * st.num_blocks for layer, _ in group])
            rows = (block_rows[None] + offset[:, None, None]).flatten(0, 1)
            private = None
            if private_of is not None:
                private = [private_of(r, name, st) for _, name in group for r in req_ids]
                if all(p is None for p in private):
                    private = None
            score_queries(st.scores, st.layout, key_cache,
                          queries_of([name for _, name in group]), visible.repeat(len(group), 1),
                          rows, sc, private)


DECODE_DEPTH = 32  # decode queries held per request between flushes


class DecodeQueryLog:
    def __init__(self, depth: int = DECODE_DEPTH) -> None:
        self.depth = depth
        self.row_of: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.visible = torch.zeros(0, depth, dtype=torch.int64)
        self.queries = QueryBuffers(depth)

    # --- bookkeeping (once per step) -----------------------------------------

    def _row(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is None:
            row = free_row(self.row_of)
            if row >= self.visible.shape[0]:  # grow by doubling
                grown = torch.zeros(max(8, 2 * self.visible.shape[0]), self.depth,
                                    dtype=torch.int64)
                grown[: self.visible.shape[0]] = self.visible
                self.visible = grown
            self.row_of[req_id] = row
            self.count[req_id] = 0
        return row

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.count.pop(req_id)
                self.visible[row] = 0

    def full(self, rows: int = 1) -> bool:
        """Whether some request has no room for `rows` more queries."""
        return any(c + rows > self.depth for c in self.count.values())

    def roll_back(self, req_id: str, num: int) -> None:
        """Forget the request's `num` newest queries: speculative decoding's
        rejected drafts (their tokens were never generated; the slots they
        wrote are written again by the next step)."""
        c = self.count.get(req_id, 0)
        num = min(num, c)
        if num > 0:
            self.visible[self.row_of[req_id], c - num:c] = 0
            self.count[req_id] = c - num

    def place(self, req_ids: list[str], q_lens: list[int], seq_lens: list[int],
              scored: list[bool] | None = None,
              drafts: list[int] | None = None) -> StepPlacement:
        """Give each decode row's queries log slots (rows with scored False get
        none): its one token, plus its speculative drafts where `drafts` says
        it has some (n = 1 + drafts; those rejected are rolled back before the
        log is read). Drop rows being prefilled. The caller flushes first if
        `full(most rows of a request)`. seq_lens are physical."""
        tokens, cells = [], []
        start = 0
        scored = scored or [True] * len(req_ids)
        drafts = drafts or [0] * len(req_ids)
        for req_id, n, s, keep, d in zip(req_ids, q_lens, seq_lens, scored, drafts):
            if keep and (n == 1 or d > 0):
                row = self._row(req_id)
                col = self.count[req_id]
                self.count[req_id] = col + n
                self.visible[row, col:col + n] = torch.arange(s - n + 1, s + 1)  # causal
                tokens.extend(range(start, start + n))
                cells.extend(range(row * self.depth + col, row * self.depth + col + n))
            elif n > 1 and req_id in self.row_of:
                self.drop([req_id])
            start += n
        as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return StepPlacement(as_long(tokens), as_long(cells))

    # --- per layer -------------------------------------------------------------

    def record(self, layer: str, query: torch.Tensor, placement: StepPlacement,
               scale: float) -> None:
        """query: (num_tokens, H_q, D) of this step."""
        self.queries.hold(layer, query, placement, self.visible.shape[0], scale)

    # --- flush -----------------------------------------------------------------

    def flush(self, req_ids: Iterable[str], stacks: list,
              block_ids_of: Callable[[str], list[int] | None],
              private_of: PrivateOf | None = None) -> None:
        """Score the waiting queries of `req_ids` in every layer, then clear them.

        stacks: the worker's layer_stack.LayerStacks (cache, layout, scores).
        block_ids_of(req_id): the request's current block ids (worker's copy),
        None if the worker no longer knows it (its queries are dropped).
        private_of(req_id, layer, stack): its private score row in that layer, or
        None (core/scoring/private_scores.py).
        """
        ids = [r for r in req_ids if self.count.get(r, 0) > 0]
        blocks = {r: block_ids_of(r) for r in ids}
        self.drop([r for r in ids if blocks[r] is None])
        ids = [r for r in ids if blocks[r] is not None]
        if not ids or not self.queries:
            return
        ids.sort(key=self.row_of.__getitem__)
        rows = rows_of([self.row_of[r] for r in ids])
        nq = max(self.count[r] for r in ids)
        score_logged(stacks, ids, [blocks[r] for r in ids], self.visible[rows, :nq],
                     self.queries.__contains__, lambda names: self.queries.take(names, rows, nq),
                     self.queries.scale, private_of)
        self.visible[rows] = 0
        for r in ids:
            self.count[r] = 0

    def flush_all(self, stacks: list, block_ids_of: Callable[[str], list[int] | None],
                  private_of: PrivateOf | None = None) -> None:
        self.flush(list(self.count), stacks, block_ids_of, private_of)
