"""Host-device syncs in each kernel's launch path, with the inputs the CUDA path
hands it, counted two ways: the counter the CPU tests use (`sync_counter`), and
on a GPU torch's own sync debug mode (every synchronising CUDA call warns). The
two must agree; the counts are the launch paths' costs per call.
"""
from __future__ import annotations

import traceback
import warnings
from collections import Counter

import torch

from vllm_kvevict.gpu_check import correctness, kernel
from vllm_kvevict.gpu_check.cases import Target
from vllm_kvevict.gpu_check.sync_counter import SyncCounter


def torch_syncs(t: Target, fn) -> tuple[int | None, list[str]]:
    """Synchronising CUDA calls of fn (torch.cuda.set_sync_debug_mode) and where
    each was made (file:line), or (None, []) off a GPU."""
    if not t.gpu:
        return None, []
    def once():
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [f"{'/'.join(w.filename.rsplit('/', 3)[-3:])}:{w.lineno}" for w in seen
                if "synchroniz" in str(w.message)]
    # The first call under the debug mode in a process saw one more sync (in
    # torch's or Triton's own first-use code, not the launch path): the second
    # call is the steady state, what a serving step pays.
    first, steady = once(), once()
    return len(steady), steady + [f"first call only: {w}" for w in first if w not in steady]


def counted(t: Target, name: str, how: str, fn, seeds, expected: int) -> dict:
    rec = {"launch path": name, "inputs": how, "expected": expected}
    try:
        fn()  # warm: compile, allocate
        c = SyncCounter()
        c.mark(*seeds)
        if not t.gpu:  # the interpreter's work is the GPU's: not counted
            from triton.runtime.interpreter import InterpretedFunction
            run = InterpretedFunction.run
            InterpretedFunction.run = c.pausing(run)
        try:
            with c.patch_tensor_methods(), c:
                fn()
        finally:
            if not t.gpu:
                InterpretedFunction.run = run
        rec["counter"] = len(c.events)
        rec["kinds"] = dict(Counter(k for k, _ in c.events))
        rec["torch"], rec["torch_where"] = torch_syncs(t, fn)
        rec["ok"] = rec["counter"] == expected and rec["torch"] in (None, expected)
    except Exception as e:  # noqa: BLE001 - reported
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=6))
    return rec


def run(t: Target) -> list[dict]:
    dev, dtype = t.device, t.dtypes[-1]
    recs = []
    # Decode scoring as core/scores.accumulate_scores launches it: every index
    # tensor already on the device, the longest length known on the host.
    kc, vc, table, rows, vis, q = correctness.paged_inputs(t, dtype, 3, 16, 64, [5, 40, 77])
    scores = torch.zeros(kc.shape[2], kc.shape[0] * 16, device=dev)
    pa = kernel("paged_attention").paged_attention_scores
    seeds = (kc, vc, table, rows, vis, q, scores)
    recs.append(counted(t, "paged_attention_scores (fused decode)", "device indices, max_visible "
                        "given", lambda: pa(q, kc, vc, table, rows, vis, 0.125, scores=scores,
                                            max_visible=77), seeds, 0))
    recs.append(counted(t, "paged_attention_scores (fused decode)", "device indices, "
                        "max_visible not given (reads max(visible))",
                        lambda: pa(q, kc, vc, table, rows, vis, 0.125, scores=scores), seeds, 1))
    wq = torch.randn(2, 8, 6, 64, device=dev).to(dtype)
    wk = torch.randn(2, 2, 50, 64, device=dev).to(dtype)
    win = kernel("window").window_raw_scores
    recs.append(counted(t, "window_raw_scores (andpro)", "device tensors",
                        lambda: win(wq, wk, wk, 0.125, projection=True), (wq, wk), 0))
    ck, cv, cs, src, dst, keep, *_ = correctness.compaction_inputs(t, dtype, 16, 100, 37, 64)
    comp = kernel("compaction").compact_in_place
    src_h, dst_h = src.cpu(), dst.cpu()
    # The worker builds the slot plans on the host: two blocking uploads, once
    # per compaction (not per step); the in-place check itself runs on the host.
    recs.append(counted(t, "compact_in_place", "host slot plans, device keep (the worker's)",
                        lambda: comp(ck, cv, cs, src_h, dst_h, keep), (ck, cv, cs, keep), 2))
    pq = torch.randn(4, 6, 19, device=dev).to(dtype)
    pk = torch.randn(4, 2, 150, 19, device=dev).to(dtype)
    cols = torch.arange(19, device=dev)
    lens = torch.tensor([150, 0, 1, 77], device=dev)
    part = kernel("partial_attention").partial_attention
    recs.append(counted(t, "partial_attention", "device tensors",
                        lambda: part(pq, pk, cols, lens, 4.0), (pq, pk, cols, lens), 0))
    return recs
