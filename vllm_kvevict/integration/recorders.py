"""What the engine records for a policy at every step, and what a policy reads
at a compaction: the two halves of the policy interface (core/policies/base.py)
on the worker's side.

A policy names what it needs recorded (`EvictionPolicy.records`, a `Record`);
`RECORDERS` maps that value to one of the classes below, which the worker, the
attention backends and their metadata builders call unconditionally (a recorder
with nothing to record does nothing):

  Recorder           Record.NOTHING: nothing per step
  AttentionRecorder  Record.ATTENTION: accumulated attention per (KV head, slot)
                     in a float32 buffer beside the cache; decode queries wait in
                     the decode log and short prefill chunks in the chunk log
                     (CPU), shared first blocks score in private rows
  QueryRecorder      Record.QUERIES: each request's newest queries in a ring

At a compaction the worker hands the policy a `StackContext` (one layer stack
of a batch of requests compacted together), which gathers what the policy reads
on first use.
"""

from __future__ import annotations

import torch

from vllm_kvevict.core.eviction.compaction import by_age
from vllm_kvevict.core.eviction.kernel_dispatch import (cpu_kernel_isa, cpu_projection_isa_of,
                                                       cpu_token_mover, projection_precision)
from vllm_kvevict.core.eviction.plans import CompactionPlan, EvictionStep
from vllm_kvevict.core.layouts.cpu_layout import FP8_VIEWS
from vllm_kvevict.core.layouts.layer_stack import LayerCache, LayerStack
from vllm_kvevict.core.policies import Record
from vllm_kvevict.core.scoring.decode_log import StepPlacement
from vllm_kvevict.core.scoring.query_buffers import QueryBuffers
from vllm_kvevict.core.scoring.scores import accumulate_scores


class Recorder:
    """Record.NOTHING: the policy scores from the cache itself (or by age)."""

    scoring = False  # scores with the kernels every step (the worker logs their CPU path)
    fuses_decode = False  # an all-decode step may run attention + recording in one kernel
    # a CPU step may take attention + recording from one pass
    # (integration/fused_attention.py)
    fuses_cpu_step = False

    def __init__(self, state: "WorkerEviction") -> None:
        self.state = state

    def score_slots(self, slots: int) -> int:
        """Columns of a layer's score buffer for a cache of `slots` slots (0: none)."""
        return 0

    def begin_step(self, step: EvictionStep) -> None:
        """At the step's start, after released requests were dropped and before
        any compaction: bring what is recorded up to date."""

    def places(self, may_defer: bool) -> bool:
        """Whether this step's queries get a placement from the builder
        (`place`); may_defer: the backend lets queries wait in the logs (CPU)."""
        return False

    def place(self, req_ids: list[str], q_lens: list[int], seq_lens: list[int],
              logical_seq_lens: list[int], scored: list[bool] | None,
              defer_chunks: bool = True,
              drafts: list[int] | None = None) -> StepPlacement | None:
        """Once per step, from the builder: where each layer keeps this step's
        queries. seq_lens physical, logical_seq_lens logical, after the step.
        defer_chunks=False: no prompt chunk waits for the next step (the fused
        CPU pass scores them in their forward). drafts: per row, speculative
        draft tokens after its token (None: none this step)."""
        return None

    def zero_new_slots(self, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        """New tokens start with zero recorded importance, whatever their slot held."""

    def log_only(self, placement: StepPlacement, num_tokens: int) -> QueryBuffers | None:
        """Once per step, from the CPU builder: the buffers that take every
        layer's queries by reference (`QueryBuffers.hold_ref`) when all `record`
        would do this step is log them, else None (the layers call `record`)."""
        return None

    def record(self, layer: str, lc: LayerCache, query: torch.Tensor, kv_cache: torch.Tensor,
               scale: float, attn_metadata, placement: StepPlacement | None,
               rows: torch.Tensor | None, host) -> None:
        """Per layer, after attention: record this step's `query` (num_tokens, H_q, D).
        rows: (num_reqs,) bool rows to record (None: all); host: the step's HostLens."""

    def compacted(self, req_id: str, recent: int) -> None:
        """The request kept only its `recent` newest tokens in order at the end."""


class AttentionRecorder(Recorder):
    """Record.ATTENTION (H2O): softmax over the resident keys, summed over the
    query heads of each GQA group, added per slot (core/scoring/scores.py)."""

    scoring = True
    fuses_decode = True
    fuses_cpu_step = True

    def score_slots(self, slots: int) -> int:
        return slots

    def begin_step(self, step: EvictionStep) -> None:
        state = self.state
        for req_id, n in step.shared_prefix.items():
            if req_id not in state.unscored:
                state.private.open(req_id, n)
        # Score what waits for requests about to move.
        state.chunk_log.flush(state._stacks(), state._block_ids, state._private_of)
        state.decode_log.flush([p.req_id for p in step.plans], state._stacks(),
                               state._block_ids, state._private_of)

    def places(self, may_defer: bool) -> bool:
        return may_defer  # CUDA scores every query in its own step

    def place(self, req_ids, q_lens, seq_lens, logical_seq_lens, scored, defer_chunks=True,
              drafts=None):
        state = self.state
        # A decode row logs its token and its drafts (the rejected ones are
        # rolled back next step, before anything reads the log).
        if state.decode_log.full(1 + max(drafts or [0])):
            state.decode_log.flush_all(state._stacks(), state._block_ids, state._private_of)
        placement = state.decode_log.place(req_ids, q_lens, seq_lens, scored, drafts)
        deferred = (state.chunk_log.place(req_ids, q_lens, seq_lens, scored, drafts)
                    if defer_chunks else None)
        placement.defer(deferred, q_lens, scored, drafts)
        return placement

    def log_only(self, placement, num_tokens):
        log = self.state.decode_log
        if placement.deferred is None and not placement.score_now and \
                log.queries.by_reference(placement, num_tokens, log.visible.shape[0]):
            return log.queries
        return None

    def zero_new_slots(self, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        state = self.state
        if not state.layers:
            return  # no layer yet: its score buffer will be made zeroed
        slots = slot_mapping[:num_tokens].long()
        for st in state._stacks():
            per_layer = st.num_blocks * state.block_size
            cols = slots[None] + per_layer * torch.arange(st.num_layers, device=slots.device)[:, None]
            st.scores.index_fill_(1, cols.flatten(), 0.0)

    def record(self, layer, lc, query, kv_cache, scale, attn_metadata, placement, rows, host):
        state = self.state
        if placement is not None:
            state.decode_log.record(layer, query, placement, scale)
            if placement.deferred is not None:  # scored at the next step's start
                state.chunk_log.record(layer, query, scale)
                rows = ~placement.deferred if rows is None else rows & ~placement.deferred
            if not placement.score_now:  # every row logged, deferred or unscored
                return  # (the builder zeroed the new slots: zero_new_slots)
        key_cache, _ = lc.layout.split(kv_cache)
        accumulate_scores(lc.scores, lc.layout, key_cache, query,
                          attn_metadata.query_start_loc, attn_metadata.seq_lens,
                          attn_metadata.block_table, attn_metadata.slot_mapping, scale,
                          decode=placement is None, rows=rows,
                          query_start_loc_cpu=host.query_start_loc, seq_lens_cpu=host.seq_lens,
                          private=state.private_rows(layer, lc,
                                                 attn_metadata.query_start_loc.shape[0] - 1))


class QueryRecorder(Recorder):
    """Record.QUERIES (SnapKV, AnDPro): the newest `--kv-window` queries of
    every request, one `index_copy_` per layer and step
    (core/scoring/query_window.py)."""

    scoring = True

    def places(self, may_defer: bool) -> bool:
        return True

    def place(self, req_ids, q_lens, seq_lens, logical_seq_lens, scored, defer_chunks=True,
              drafts=None):
        return self.state.query_window.place(req_ids, q_lens, logical_seq_lens, scored)

    def log_only(self, placement, num_tokens):
        win = self.state.query_window
        return win.queries if win.queries.by_reference(placement, num_tokens, win.capacity) else None

    def record(self, layer, lc, query, kv_cache, scale, attn_metadata, placement, rows, host):
        if placement is not None:
            self.state.query_window.record(layer, query, placement, scale)

    def compacted(self, req_id: str, recent: int) -> None:
        self.state.query_window.compacted(req_id, recent)


RECORDERS: dict[Record, type[Recorder]] = {
    Record.NOTHING: Recorder, Record.ATTENTION: AttentionRecorder, Record.QUERIES: QueryRecorder,
}


class StackContext:
    """`CompactionContext` of one layer stack of a batch of P requests
    compacted together (`WorkerEviction._batches`: the same old_len, new_len
    and recent): what the policy may read, gathered on first use and in age
    order (oldest first). Its rows are (request, layer) pairs, row p * L + l
    layer l of plans[p]; `num_layers` counts rows (P * L).

    rows: (P*L, H, old_len) slot of each token by age (None: slot order is age
    order); src_rows (P*L, n_src) the stack's block rows of the requests' old
    blocks, src_slots (P*L, old_len) their slots; private (L, H, n) the
    request's private scores of its shared first tokens (P = 1), or None."""

    def __init__(self, state: "WorkerEviction", plans: list[CompactionPlan], st: LayerStack,
                 rows: torch.Tensor | None, src_rows: torch.Tensor, src_slots: torch.Tensor,
                 private: torch.Tensor | None) -> None:
        self.state, self.plans, self.st = state, plans, st
        self.rows, self.src_rows, self.src_slots, self.private = rows, src_rows, src_slots, private
        self.num_layers, self.num_kv_heads = st.num_layers * len(plans), st.layout.num_kv_heads
        plan = plans[0]
        self.old_len, self.new_len, self.recent = plan.old_len, plan.new_len, plan.recent
        self.device = st.kv_cache.device
        self._k = self._v = self._slots = None
        self._window: tuple | None = None
        self._window_read = False

    def _gather(self, values: bool) -> torch.Tensor:
        st, n = self.st, self.src_rows.shape[1]
        kc, vc = st.layout.split(st.kv_cache)
        mover = cpu_token_mover(st.layout, kc)
        if mover is not None and hasattr(mover, "read_tokens"):  # one pass, in C++
            offsets = st.layout.element_offsets(kc, vc)[1 if values else 0]
            x = mover.read_tokens(vc if values else kc, offsets, self._slots_by_age())
        else:
            x = (st.layout.gather_values(vc, self.src_rows, n) if values
                 else st.layout.gather_keys(kc, self.src_rows, n))
            x = by_age(x[:, :, : self.old_len], self.rows)
        # An fp8 cache's float8 values are exact in bf16, which the scoring
        # paths (and their compiled kernels) take.
        return x.to(torch.bfloat16) if x.dtype in FP8_VIEWS else x

    def _slots_by_age(self) -> torch.Tensor:
        """(L, H, old_len) int64 slot of each token, oldest first (K and V share it)."""
        if self._slots is None:
            if self.rows is None:
                slots = self.src_slots[:, None].expand(-1, self.num_kv_heads, -1)
            else:
                slots = self.src_slots.gather(1, self.rows.flatten(1).long()).view_as(self.rows)
            self._slots = slots.contiguous()
        return self._slots

    def keys(self) -> torch.Tensor:
        if self._k is None:
            self._k = self._gather(values=False)
        return self._k

    def values(self) -> torch.Tensor:
        if self._v is None:
            self._v = self._gather(values=True)
        return self._v

    def window_attention_sums(self, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """SnapKV's raw scores read in place from the paged cache by the
        compiled CPU kernel (no gather of every layer's keys), or None where
        that kernel does not run on this cache, or where the window's w tokens
        are not the request's last w slots in age order (then `keys()`).

        Slot order may stand in for age order: every token outside the window
        is older than every window query, so each query sees all of them
        wherever they lie, and the window's own causal mask needs only its
        tokens in order at the end. That holds at the first compaction and
        whenever at least w tokens were appended since the last one (decode
        compacts once per block: w <= block size)."""
        st, n, w = self.st, self.old_len, q.shape[1]
        kc, _ = st.layout.split(st.kv_cache)
        isa = cpu_kernel_isa(q, kc, st.layout)
        if isa is None or not 0 < w <= n:
            return None
        if self.rows is not None:
            tail = self.rows[..., n - w:]
            if not torch.equal(tail, torch.arange(n - w, n, dtype=tail.dtype).expand_as(tail)):
                return None
        from vllm_kvevict import cpu_kernel

        visible = torch.arange(n - w + 1, n + 1).expand(self.num_layers, w)
        sums = cpu_kernel.column_sums(st.layout, kc, q, visible, self.src_rows, scale, isa)
        sums = sums[..., :n]  # (L, H, n) in slot order
        return sums if self.rows is None else sums.gather(2, self.rows.long())

    def window_value_projection(self, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """AnDPro's raw scores with the keys and values read in place from the
        paged cache by the compiled CPU kernel (no (L, H, n, D) gather of
        either), or None where that kernel does not run on this cache or on
        these queries (then `keys()` and `values()`). The kernel reads each
        row's tokens oldest first through the slots `keys()` would read, so
        age order holds whatever slots the tokens occupy."""
        st = self.st
        kc, vc = st.layout.split(st.kv_cache)
        if cpu_token_mover(st.layout, kc) is None or q.dtype != kc.dtype:
            return None  # (the kernel does not widen the cache: mixed dtypes gather)
        isa = cpu_projection_isa_of(q, kc, vc.dtype, self.old_len)
        if isa is None:
            return None
        from vllm_kvevict import cpu_kernel

        return cpu_kernel.window_projection_paged(st.layout, kc, vc, q, self._slots_by_age(), scale,
                                                  isa, split=projection_precision() == "float32")

    def accumulated(self) -> torch.Tensor:
        if not self.st.scores.shape[1]:
            raise RuntimeError(f"policy {self.state.policy.name!r} reads accumulated attention "
                               "but does not record it: declare records = Record.ATTENTION")
        # index_select of the flat slots, not scores[:, src_slots]: a third of
        # the time at a compaction's (57, 160) slots (advanced indexing's
        # TensorIterator pays per element).
        slots = self.src_slots
        at_slots = self.st.scores.index_select(1, slots.flatten()).view(-1, *slots.shape)
        scores = by_age(at_slots.transpose(0, 1), self.rows)
        if self.private is not None:  # never compacted yet: slot order is age order
            assert self.rows is None
            n = min(self.private.shape[2], self.old_len)
            scores[..., :n] = self.private[..., :n]
        return scores

    def window(self) -> tuple[torch.Tensor, float] | None:
        if not self._window_read:
            self._window_read = True
            ring, plans = self.state.query_window, self.plans
            self._window = ring.windows([p.req_id for p in plans], self.st.names,
                                        [p.logical_len for p in plans])
            if self._window is None:
                # `_batches` batches equal window lengths only: all or none.
                assert len({ring.window_len(p.req_id, p.logical_len) for p in plans}) == 1, \
                    "a batch mixes windowed and windowless plans"
                self.state.num_windowless += len(plans)
        return self._window
