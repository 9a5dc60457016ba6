"""Host-device synchronisations per step of the CUDA path, counted on CPU (issue 20 #10).

The CUDA backend's Python (the metadata builder and `forward`, with
attention_common, scores, the Triton launchers) runs here on CPU tensors, set
up as tests/test_cuda_path.py does: a real FlashAttentionMetadataBuilder from a
real VllmConfig, stand-ins only for vLLM's CUDA ops (the FlashAttention kernel,
``reshape_and_cache_flash``); the Triton kernels run in the interpreter.

How a sync is recognised: `vllm_kvevict.gpu_check.sync_counter.SyncCounter`
(its docstring), the same counter gpu_check runs beside torch's own sync debug
mode on a real GPU. Here the seeds marked as device tensors are the step's
device-side metadata (query_start_loc, seq_lens, block_table_tensor,
slot_mapping), the queries, keys, values, output and KV cache, and the score
buffers; vLLM's ``query_start_loc_cpu`` / ``seq_lens_cpu_upper_bound``, the
worker state's per-row lists and tensors made without a ``device=`` are host
tensors. GPU work itself is not counted: the Triton interpreter and the
stand-ins for vLLM's CUDA ops run with the counter paused (on a GPU they are
launches).

Scope: one step's builder (ours and the stock FlashAttentionMetadataBuilder.build
it calls, whose FA3 AOT scheduling is off here: no FA3 on CPU) and every
layer's forward. Not counted: compaction (`WorkerEviction.begin_step`, once per
plan, not per step).

Limits: code that moves data to the host with ``.to("cpu")`` or copies a device
tensor into a host buffer some other way than ``copy_`` would be misread; the
CUDA path does neither. Each pinned count lists where its syncs come from.
"""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import vllm.v1.attention.backends.flash_attn as fa
from test_cuda_path import (  # noqa: F401  (vllm_cfg is a fixture)
    BLOCKS,
    HKV,
    HQ,
    D,
    flash_cache,
    make_builder,
    make_impl,
    reshape_and_cache_flash,
    vllm_cfg,
)
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_kvevict.gpu_check.sync_counter import SyncCounter
from vllm_kvevict.integration import worker


def test_counter_sees_what_it_should(monkeypatch):
    """The counter itself, on the operations it is meant to catch and to let pass."""
    c = SyncCounter()
    x = torch.arange(6)
    host = torch.tensor([1, 2])
    c.mark(x)
    with c.patch_tensor_methods(monkeypatch), c:
        y = x * 2  # device, no sync
        int(y.max())
        bool((y > 3).any())
        y[y > 3]
        torch.nonzero(y)
        y.cpu()
        y.tolist()
        torch.repeat_interleave(y[:2], host.to(y.device))
        torch.repeat_interleave(y[:2], y[:2], output_size=2)  # sized: no sync
        y[host.to(y.device, non_blocking=True)]  # an upload, then a device index
        y[host]
        host.tolist()  # host reads are free
        int(host.sum())
        z = y.cpu()
        int(z.sum())  # the host copy is host
        w = torch.arange(3, device=y.device)  # made on the device
        w[host.to(w.device, non_blocking=True)].tolist()
        torch.arange(3).tolist()  # made on the host
        torch.tensor([1, 2], device=y.device)
    kinds = Counter(k for k, _ in c.events)
    assert kinds == Counter({"item": 2, "boolean-mask indexing": 1, "nonzero": 1,
                             "Tensor.cpu()": 2, "Tensor.tolist()": 2,
                             "blocking torch.tensor(..., device=)": 1,
                             "blocking .to(device) of a host tensor": 1,
                             "repeat_interleave without output_size": 1,
                             "host index into a device tensor": 1}), c.events
    assert len(c.uploads) == 2


# --- one step of the CUDA path, two requests, two layers -------------------------------

EVICTED = {"a": 8, "c": 30}
ROWS = [0, 2]  # BLOCKS rows of requests a and c
LAYERS = ("l0", "l1")


def metadata(kind: str, host_copy: bool = True) -> CommonAttentionMetadata:
    """The step as vLLM's GPU runner hands it to the builder: logical lengths,
    device tensors plus vLLM's host copies (query_start_loc_cpu and, unless
    host_copy is False, seq_lens_cpu_upper_bound: exact here, as without async
    scheduling, which eviction turns off).
    decode: a (logical 40, physical 32) and c (70 / 40) decode one token each.
    mixed: a decodes, c runs a 5-token chunk (logical 74 / physical 44)."""
    if kind == "decode":
        qsl, seq, slots = [0, 1, 2], [40, 70], [1 * 16 + 7, 8 * 16 + 5]
    else:
        qsl, seq, slots = [0, 1, 6], [40, 74], [1 * 16 + 7] + [8 * 16 + 9 + i for i in range(5)]
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t, seq_lens=seq_t.clone(),
        seq_lens_cpu_upper_bound=seq_t.clone() if host_copy else None, num_reqs=2,
        num_actual_tokens=qsl[-1], max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq), block_table_tensor=BLOCKS[ROWS].clone(),
        slot_mapping=torch.tensor(slots, dtype=torch.int64))


DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping")


def run_step(vllm_cfg, monkeypatch, policy: str, kind: str, path: str = "triton",
             host_copy: bool = True):
    """Build the step's metadata and run both layers' forward; the second of two
    identical steps is counted (the first makes the score buffers and rings).
    Returns the counter, the counted step's metadata and the worker state."""
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", path)
    dtype = torch.float32 if path == "triton" else torch.bfloat16  # no bf16 in the interpreter
    vc = vllm_cfg({"kv_eviction": policy, "kv_budget": 64})
    impls = {name: make_impl(vc, sliding_window=None) for name in LAYERS}
    builder, _ = make_builder(vc)
    state = worker.worker_state()
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "c"]), requests={})
    caches = {name: flash_cache(dtype=dtype) for name in LAYERS}
    g = torch.Generator().manual_seed(5)
    n = metadata(kind).num_actual_tokens
    qkv = {name: [torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)]
           for name in LAYERS}
    layers = {name: SimpleNamespace(layer_name=name, _k_scale=torch.ones(()),
                                    _v_scale=torch.ones(())) for name in LAYERS}

    counter = SyncCounter()
    # Stand-ins for GPU work (vLLM's CUDA ops, Triton launches): not counted.
    monkeypatch.setattr(fa, "reshape_and_cache_flash",
                        counter.pausing(reshape_and_cache_flash), raising=False)
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward",
                        counter.pausing(lambda self, *a: a[6]))  # returns `output`
    from triton.runtime.interpreter import InterpretedFunction
    monkeypatch.setattr(InterpretedFunction, "run", counter.pausing(InterpretedFunction.run))

    def step(counted: bool):
        state.begin_step(runner, SimpleNamespace(finished_req_ids=set()))
        state.evicted = dict(EVICTED)
        cm = metadata(kind, host_copy)
        outs = {name: torch.zeros(n, HQ, D, dtype=dtype) for name in LAYERS}
        if not counted:
            md = builder.build(0, cm)
            for name in LAYERS:
                impls[name].forward(layers[name], *qkv[name], caches[name], md, outs[name])
            return md
        counter.mark(*(getattr(cm, f) for f in DEVICE_FIELDS), *caches.values(),
                     *qkv.values(), *outs.values(),
                     *(state.layers[name].scores for name in LAYERS))
        with counter.patch_tensor_methods(monkeypatch), counter:
            md = builder.build(0, cm)
            for name in LAYERS:
                impls[name].forward(layers[name], *qkv[name], caches[name], md, outs[name])
        return md

    step(False)
    md = step(True)
    return counter, md, state


def where(place: str) -> str:
    """'file:function' of a recorded place (line numbers left out: they move)."""
    return f"{place.split(':')[0]}:{place.split(' ')[-1]}"


# Per (policy, step, kernels): the syncs and the asynchronous uploads of one step
# (builder + 2 layers). Before issue 20 #10 the same steps had, on the Triton path:
#   h2o decode  3 = physical_view: evicted.to(dev) (blocking upload; now in
#                   _physical_slots, asynchronous),
#                   repeat_interleave without output_size, int(seq.max())
#   h2o mixed  23 = those 3 + per layer 10 (accumulate_scores: query_start_loc.cpu(),
#                   seq_lens.cpu(), 3 blocking uploads; score_queries for the chunk:
#                   visible.to(dev), int(seen.min()), bool(all()), 2 boolean masks)
#   snapkv decode 9 = those 3 + the builder's 2 seq_lens.cpu() + per layer 2
#                   blocking uploads of the ring placement (store_queries)
# and on the torch path (VLLM_KVEVICT_KERNELS=torch) an h2o decode step 21 = 3 +
# per layer 9 (accumulate_scores' 2 reads and 2 blocking uploads, score_queries' 5).
# Now every length the Python needs comes from vLLM's host copies, host
# tensors go up with kernels.upload (pinned, non_blocking): no syncs.
SCORES = "vllm_kvevict/core/scoring/scores.py"
COMMON = "vllm_kvevict/integration/attention_common.py"
PINNED = {
    ("h2o", "decode", "triton"): (0, [f"{COMMON}:_physical_slots"]),  # the evicted offsets
    ("h2o", "mixed", "triton"): (0, [f"{COMMON}:_physical_slots"] + 2 * (
        # decode rows for the score kernel: their query indices, rows, lengths
        3 * [f"{SCORES}:accumulate_scores"]
        # the chunk, torch scorer: per-query horizons (per tile), reached (row, key) pairs
        + [f"{SCORES}:_column_sums"] + 2 * [f"{SCORES}:score_queries"])),
    ("snapkv", "decode", "triton"): (0, [f"{COMMON}:_physical_slots"]
                                     # the ring placement, once for both layers
                                     + 2 * ["vllm_kvevict/integration/cuda_backend.py:build"]),
    # The torch path (VLLM_KVEVICT_KERNELS=torch on CUDA): decode rows through
    # score_queries (query indices and rows; horizons, reached pairs).
    ("h2o", "decode", "torch"): (0, [f"{COMMON}:_physical_slots"] + 2 * (
        2 * [f"{SCORES}:accumulate_scores"] + [f"{SCORES}:_column_sums"]
        + 2 * [f"{SCORES}:score_queries"])),
}


@pytest.mark.parametrize("policy,kind,path", list(PINNED))
def test_syncs_per_step(vllm_cfg, monkeypatch, policy, kind, path):
    counter, md, _ = run_step(vllm_cfg, monkeypatch, policy, kind, path)
    syncs, uploads = PINNED[(policy, kind, path)]
    assert len(counter.events) == syncs, show(counter)
    assert sorted(map(where, counter.uploads)) == sorted(uploads), counter.uploads
    # The physical view the forward saw, built from host lengths.
    assert md.seq_lens.tolist() == ([32, 40] if kind == "decode" else [32, 44])
    assert md.max_seq_len == max(md.seq_lens.tolist())


def test_without_host_lengths_the_device_is_read(vllm_cfg, monkeypatch):
    """Metadata without seq_lens_cpu_upper_bound (not from vLLM's runner) still
    works, at the price of reading the lengths back: physical_view's max, and
    per layer accumulate_scores' seq_lens."""
    counter, md, _ = run_step(vllm_cfg, monkeypatch, "h2o", "mixed", host_copy=False)
    assert sorted((kind, where(place)) for kind, place in counter.events) == [
        ("Tensor.cpu()", f"{SCORES}:accumulate_scores"),
        ("Tensor.cpu()", f"{SCORES}:accumulate_scores"),
        ("item", f"{COMMON}:physical_view"),
    ], show(counter)
    assert md.max_seq_len == 44


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_host_lengths_give_the_same_scores(vllm_cfg, monkeypatch, path):
    """A mixed step scored from vLLM's host copies and from the device tensors:
    the same scores, bit for bit."""
    _, _, state = run_step(vllm_cfg, monkeypatch, "h2o", "mixed", path, host_copy=True)
    with_host = {n: state.layers[n].scores.clone() for n in LAYERS}
    _, _, state = run_step(vllm_cfg, monkeypatch, "h2o", "mixed", path, host_copy=False)
    for n in LAYERS:
        assert torch.equal(with_host[n], state.layers[n].scores)
        assert with_host[n].abs().sum() > 0


def show(counter) -> str:
    return "\n".join(f"{k} @ {w}" for k, w in counter.events)
