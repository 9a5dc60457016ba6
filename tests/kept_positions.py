"""Which logical position each (layer, KV head) slot holds after each compaction:
the oracle the reference tests compare with a dense run.

Recorded from outside the worker, on one `WorkerEviction` instance: its
`_compact` and its policy's `select` are wrapped (instance attributes, the
class is untouched), and so is the worker module's `select_and_fill_holes`
(the compiled kernel's selection, which the worker takes instead of `select`
where it can). `_compact` runs a batch of plans and selects once per layer
stack, by either, in the order of `_stacks()`, with that stack's (plans *
layers * KV heads, tokens) scores in age order (oldest first), and keeps the
returned indices; a compaction's kept
positions are the positions before it, gathered at those indices. The first
compaction of a request starts from 0 .. old_len - 1; tokens added since the
last one follow it (logical_len then grows by one per token).

    rec = KeptRecorder(state)          # from now on
    ... generate ...
    rec.kept[req_id].positions         # (layers, KV heads, kept) int64, last compaction
    rec.compactions                    # [(plan, positions)], every compaction in order
    rec.selected_by                    # {"kernel": n, "select": n}: which path selected
    rec.remove()                       # back to the class's methods

A recorder installed again on the same state replaces the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.integration import worker as worker_module


@dataclass
class KeptRecord:
    """(L, H, new_len) int64 logical positions after a compaction, and the
    request's logical length then."""
    positions: torch.Tensor
    logical_len: int


class KeptRecorder:
    def __init__(self, state) -> None:
        previous = vars(state).get("_kept_recorder")
        if previous is not None:
            previous.remove()
        self.state = state
        self.kept: dict[str, KeptRecord] = {}
        self.compactions: list[tuple[object, torch.Tensor]] = []
        self._keeps: list[torch.Tensor] | None = None
        self.selected_by = {"kernel": 0, "select": 0}
        self._compact = state._compact  # bound: the class's method, or a test's spy
        self._select = state.policy.select
        self._fused = worker_module.select_and_fill_holes
        state._compact = self._recording_compact
        state.policy.select = self._recording_select
        worker_module.select_and_fill_holes = self._recording_fused
        state._kept_recorder = self

    def remove(self) -> None:
        state = self.state
        if vars(state).get("_kept_recorder") is not self:
            return
        del state._kept_recorder
        if vars(state).get("_compact") == self._recording_compact:
            del state._compact
        if vars(state.policy).get("select") == self._recording_select:
            del state.policy.select
        if worker_module.select_and_fill_holes == self._recording_fused:
            worker_module.select_and_fill_holes = self._fused

    def _recording_select(self, scores, keep, recent):
        out = self._select(scores, keep, recent)
        if self._keeps is not None:
            self._keeps.append(out)
            self.selected_by["select"] += 1
        return out

    def _recording_fused(self, *args, **kwargs):
        out = self._fused(*args, **kwargs)  # (kept, slots after) or None
        if out is not None and self._keeps is not None:
            self._keeps.append(out[0])
            self.selected_by["kernel"] += 1
        return out

    def _recording_compact(self, plans) -> None:
        self._keeps = []
        try:
            self._compact(plans)
            keeps = self._keeps
        finally:
            self._keeps = None
        stacks = self.state._stacks()
        assert len(keeps) == len(stacks), (
            f"{len(keeps)} selections for {len(stacks)} layer stacks: "
            "WorkerEviction._compact no longer selects once per stack")
        # Each select covers the batch's rows, request-major: (P * L * H, new_len).
        per_stack = [k.view(len(plans), st.num_layers, st.layout.num_kv_heads, -1).cpu()
                     for k, st in zip(keeps, stacks)]
        for i, plan in enumerate(plans):
            keep = torch.cat([k[i] for k in per_stack])  # (L_all, H, new_len)
            logical = self._positions_before(self.kept.get(plan.req_id), plan)
            if logical.dim() == 1:
                logical = logical.expand(*keep.shape[:2], -1)
            positions = logical.gather(2, keep)
            self.kept[plan.req_id] = KeptRecord(positions, plan.logical_len)
            self.compactions.append((plan, positions))

    @staticmethod
    def _positions_before(prev: KeptRecord | None, plan) -> torch.Tensor:
        """Logical position of each of the old_len tokens, oldest first: (L, H, n) or (n,)."""
        if prev is None:
            return torch.arange(plan.old_len)
        fresh = torch.arange(prev.logical_len, plan.logical_len)
        fresh = fresh.expand(*prev.positions.shape[:2], -1)
        return torch.cat([prev.positions, fresh], dim=2)[:, :, : plan.old_len]
