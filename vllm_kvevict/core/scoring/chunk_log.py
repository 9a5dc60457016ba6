"""Short prefill chunks wait here and are scored at the start of the next step (H2O).

A request's last prompt chunk is often short: the question after a cached
system prompt, the tail of a long prompt. Scored in its forward, it costs time
in the very step that yields the request's first token (for a 23-token chunk
over 2K cached keys, about as much as the forward itself on this CPU). Scored
at the start of the next step instead, before anything is compacted, it gives
the same scores: its keys have not moved (compaction comes after the flush),
and each query keeps the physical length it saw, as in the decode log. A
request that ends with its first token is never scored at all.

At most `max_tokens` prefill tokens per step are deferred: their queries are
held for one step, (max_tokens, H_q, D) per layer. Longer chunks are scored in
their forward.

    queries[layer]: (N, H_q, D) this step's deferred queries, in entry order
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from vllm_kvevict.core.scoring.decode_log import PrivateOf, score_logged


@dataclass(frozen=True)
class Chunk:
    req_id: str
    start: int    # its first query's row in `queries`
    n: int        # tokens in the chunk
    seq_len: int  # physical length after it: query t sees seq_len - n + 1 + t keys


CHUNK_TOKENS = 256  # prefill tokens deferred per step, at most


class ChunkLog:
    def __init__(self, max_tokens: int = CHUNK_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.chunks: list[Chunk] = []
        self.tokens = torch.empty(0, dtype=torch.int64)  # their rows in the step's query
        self.queries: dict[str, torch.Tensor] = {}
        self.scale: dict[str, float] = {}
        self.deferred_tokens = 0  # since start

    def place(self, req_ids: list[str], q_lens: list[int], seq_lens: list[int],
              scored: list[bool] | None = None,
              drafts: list[int] | None = None) -> torch.Tensor | None:
        """Take this step's prefill rows (n > 1, scored; not a decode row with
        speculative `drafts`, which the decode log takes) while they fit in
        max_tokens, in batch order. seq_lens are physical. Returns the (num_reqs,)
        bool mask of the rows taken (to score later, not now), or None."""
        assert not self.chunks, "flush() the previous step's chunks first"
        taken = [False] * len(req_ids)
        tokens, total, start = [], 0, 0
        for i, (req_id, n, s) in enumerate(zip(req_ids, q_lens, seq_lens)):
            if (n > 1 and (scored is None or scored[i]) and not (drafts and drafts[i])
                    and total + n <= self.max_tokens):
                self.chunks.append(Chunk(req_id, total, n, s))
                tokens.append(torch.arange(start, start + n))
                taken[i] = True
                total += n
            start += n
        if not self.chunks:
            return None
        self.deferred_tokens += total
        self.tokens = torch.cat(tokens)
        return torch.tensor(taken, dtype=torch.bool)

    def record(self, layer: str, query: torch.Tensor, scale: float) -> None:
        """query: (num_tokens, H_q, D) of this step; keeps a copy of the chunks'."""
        if self.chunks:
            self.queries[layer] = query[self.tokens.to(query.device)]
            self.scale[layer] = scale

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget the chunks of requests whose blocks were freed (finished,
        aborted, preempted): their blocks may already hold another's KV."""
        gone = set(req_ids)
        self.chunks = [c for c in self.chunks if c.req_id not in gone]

    def flush(self, stacks: list, block_ids_of: Callable[[str], list[int] | None],
              private_of: PrivateOf | None = None) -> None:
        """Score every waiting chunk in every layer, then clear the log.

        stacks: the worker's layer_stack.LayerStacks; block_ids_of / private_of as for
        DecodeQueryLog.flush (a request the worker no longer knows is skipped)."""
        chunks, self.chunks = self.chunks, []
        queries, self.queries = self.queries, {}
        blocks = {c.req_id: block_ids_of(c.req_id) for c in chunks}
        chunks = [c for c in chunks if blocks[c.req_id] is not None]
        if not chunks or not queries:
            return
        # One padded row per chunk: (R, Q) rows of `queries`, and the keys each
        # query sees (0 for padding, which adds nothing).
        nq = max(c.n for c in chunks)
        index = torch.zeros(len(chunks), nq, dtype=torch.int64)
        visible = torch.zeros(len(chunks), nq, dtype=torch.int64)
        for i, c in enumerate(chunks):
            index[i, : c.n] = torch.arange(c.start, c.start + c.n)
            visible[i, : c.n] = torch.arange(c.seq_len - c.n + 1, c.seq_len + 1)
        ids = [c.req_id for c in chunks]
        score_logged(stacks, ids, [blocks[r] for r in ids], visible,
                     queries.__contains__,
                     lambda names: torch.cat([queries[n][index.to(queries[n].device)] for n in names]),
                     self.scale, private_of)
