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

from vllm_kvevict.core.decode_log import PrivateOf
from vllm_kvevict.core.scores import score_queries


@dataclass(frozen=True)
class Chunk:
    req_id: str
    n: int        # tokens in the chunk
    seq_len: int  # physical length after it: query t sees seq_len - n + 1 + t keys


class ChunkLog:
    def __init__(self, max_tokens: int = 256) -> None:
        self.max_tokens = max_tokens
        self.chunks: list[Chunk] = []
        self.tokens = torch.empty(0, dtype=torch.int64)  # their rows in the step's query
        self.queries: dict[str, torch.Tensor] = {}
        self.scale: dict[str, float] = {}
        self.deferred_tokens = 0  # since start

    def place(self, req_ids: list[str], q_lens: list[int], seq_lens: list[int],
              scored: list[bool] | None = None) -> torch.Tensor | None:
        """Take this step's prefill rows (n > 1, scored) while they fit in
        max_tokens, in batch order. seq_lens are physical. Returns the (num_reqs,)
        bool mask of the rows taken (to score later, not now), or None."""
        assert not self.chunks, "flush() the previous step's chunks first"
        taken = [False] * len(req_ids)
        tokens, total, start = [], 0, 0
        for i, (req_id, n, s) in enumerate(zip(req_ids, q_lens, seq_lens)):
            if n > 1 and (scored is None or scored[i]) and total + n <= self.max_tokens:
                self.chunks.append(Chunk(req_id, n, s))
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
        if not gone.intersection(c.req_id for c in self.chunks):
            return
        keep = [i for i, c in enumerate(self.chunks) if c.req_id not in gone]
        offsets = torch.tensor([0] + [c.n for c in self.chunks]).cumsum(0)
        rows = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in keep]
                         or [torch.empty(0, dtype=torch.int64)])
        self.chunks = [self.chunks[i] for i in keep]
        self.queries = {k: q[rows.to(q.device)] for k, q in self.queries.items()}

    def flush(self, layers: dict, block_ids_of: Callable[[str], list[int] | None],
              private_of: PrivateOf | None = None) -> None:
        """Score every waiting chunk in every layer, then clear the log.

        layers: name -> layer_stack.LayerCache; block_ids_of / private_of as for
        DecodeQueryLog.flush (a request the worker no longer knows is skipped)."""
        chunks, self.chunks = self.chunks, []
        queries, self.queries = self.queries, {}
        if not queries:
            return
        start = 0
        for c in chunks:
            blocks = block_ids_of(c.req_id)
            if blocks is not None:
                any_layer = next(iter(layers.values()))
                nblk = -(-c.seq_len // any_layer.layout.block_size)
                block_rows = torch.tensor(blocks[:nblk], dtype=torch.int64)[None]
                visible = torch.arange(c.seq_len - c.n + 1, c.seq_len + 1)[None]
                for name, q in queries.items():
                    lc = layers[name]
                    key_cache, _ = lc.layout.split(lc.kv_cache)
                    private = None if private_of is None else private_of(c.req_id, name, lc)
                    score_queries(lc.scores, lc.layout, key_cache, q[None, start:start + c.n],
                                  visible, block_rows, self.scale[name],
                                  None if private is None else [private])
            start += c.n
