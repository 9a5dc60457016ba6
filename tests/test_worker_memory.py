"""An auto-sized KV cache leaves room for what eviction holds beside it.

vLLM sizes the cache to fill the memory its check finds; eviction's buffers
(core/eviction/footprint.py) come after, and on a CPU sized by vLLM they took
the worker past its share into the OOM killer (patches/worker_memory.py). The
arithmetic is checked here, then a real engine sized by vLLM itself runs a
workload that compacts, and the KV cache vLLM allocated plus every tensor the
worker's eviction state holds at any step must fit in vLLM's figure.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPE, PROMPTS, kv_bytes

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.footprint import (Footprint, cache_share, footprint,
                                                  held_bytes)

# SmolLM2-135M: 30 layers, 3 KV heads, 9 query heads, head size 64.
SMOL = dict(num_layers=30, num_kv_heads=3, num_q_heads=9, head_size=64, query_bytes=2)
SLOT_BF16 = 30 * 3 * 2 * 64 * 2  # K and V of one token, every layer: 23,040 bytes


def _cfg(policy: str, **extra) -> EvictionConfig:
    return EvictionConfig.from_dict({"kv_eviction": policy, **extra})


@pytest.mark.parametrize("policy,per_slot,per_request,fixed", [
    # order (int32) per layer and KV head, + H2O's float32 score
    ("h2o", 30 * 3 * 8, 32 * 30 * 9 * 64 * 2 + 32 * 8, 256 * 30 * 9 * 64 * 2),
    ("snapkv", 30 * 3 * 4, 32 * 30 * 9 * 64 * 2, 0),  # the window: --kv-window 32
    ("andpro", 30 * 3 * 4, 32 * 30 * 9 * 64 * 2, 0),
    ("streaming", 30 * 3 * 4, 0, 0),
    ("none", 0, 0, 0),
])
def test_footprint_per_policy(policy, per_slot, per_request, fixed):
    fp = footprint(_cfg(policy), **SMOL, on_cpu=True)
    assert fp == Footprint(per_slot, per_request, fixed)


def test_footprint_follows_the_window_and_the_offload_pool():
    fp = footprint(_cfg("snapkv", kv_window=8), **SMOL, on_cpu=True)
    assert fp.per_request == 8 * 30 * 9 * 64 * 2
    pool = 1 << 30  # --kv-swap-space 1 (GiB, as vLLM's --swap-space reads it)
    on_cpu = footprint(_cfg("infinigen", kv_swap_space=1), **SMOL, on_cpu=True)
    on_gpu = footprint(_cfg("infinigen", kv_swap_space=1), **SMOL, on_cpu=False)
    assert on_cpu.fixed - on_gpu.fixed == pool  # host memory is the cache's only on CPU


def test_footprint_holds_the_drafts_rows():
    """Speculative decoding, k drafts a step: the window keeps k spare queries
    and H2O's decode log is 1 + k deep where that passes DECODE_DEPTH
    (worker.py: QueryWindow(window, spare=k), DecodeQueryLog(max(...)))."""
    from vllm_kvevict.core.scoring.decode_log import DECODE_DEPTH

    query = 30 * 9 * 64 * 2
    assert footprint(_cfg("snapkv"), **SMOL, on_cpu=True, drafts=4).per_request == 36 * query
    assert footprint(_cfg("h2o"), **SMOL, on_cpu=True, drafts=4) == \
        footprint(_cfg("h2o"), **SMOL, on_cpu=True)  # 1 + 4 <= DECODE_DEPTH
    deep = footprint(_cfg("h2o"), **SMOL, on_cpu=True, drafts=2 * DECODE_DEPTH)
    assert deep.per_request == (2 * DECODE_DEPTH + 1) * (query + 8)
    assert footprint(_cfg("streaming"), **SMOL, on_cpu=True, drafts=4).per_request == 0


def test_h2o_on_cuda_keeps_no_query_logs():
    """On CUDA H2O scores every query in its own step (recorders.places): per
    slot as on CPU, no decode or chunk log; SnapKV's window is kept on both."""
    cpu, cuda = (footprint(_cfg("h2o"), **SMOL, on_cpu=c) for c in (True, False))
    assert cuda == Footprint(cpu.per_slot, 0, 0)
    assert footprint(_cfg("snapkv"), **SMOL, on_cpu=False) == \
        footprint(_cfg("snapkv"), **SMOL, on_cpu=True)


@pytest.mark.parametrize("available", [1 << 30, 20 << 30, 3 * 10**9 + 7])
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "infinigen"])
def test_cache_share_fits_and_wastes_less_than_a_slot(policy, available):
    fp = footprint(_cfg(policy, **({"kv_swap_space": 0.25} if policy == "infinigen" else {})),
                   **SMOL, on_cpu=True)
    share = cache_share(available, SLOT_BF16, fp, max_requests=128)
    slots = share // SLOT_BF16
    assert share + fp.bytes(slots, 128) <= available
    # one slot more would not fit (the share is as large as it can be)
    assert (slots + 1) * SLOT_BF16 + fp.bytes(slots + 1, 128) > available


def test_cache_share_refuses_when_the_logs_leave_nothing():
    fp = footprint(_cfg("snapkv"), **SMOL, on_cpu=True)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        cache_share(100 << 20, SLOT_BF16, fp, max_requests=1024)  # 2.2 GiB of windows


def test_held_bytes_counts_distinct_storages_and_enters_only_ours():
    from vllm_kvevict.core.layouts.layer_stack import LayerCache

    big = torch.zeros(1000)
    foreign = type("Foreign", (), {})()  # not this package's: not entered
    foreign.t = torch.zeros(10**6)
    lc = LayerCache(torch.zeros(64), None, big[:10])  # a view: the whole storage counts
    held = {"a": [lc, big[500:], (big,)], "b": foreign, "c": torch.zeros(3, dtype=torch.int32)}
    assert held_bytes(held) == 4000 + 64 * 4 + 12
    assert held_bytes(held, exclude={lc.kv_cache.untyped_storage().data_ptr()}) == 4012


def test_stacking_keeps_each_layers_scores():
    from vllm_kvevict.core.layouts.layer_stack import LayerCache, LayerStack

    buf = torch.zeros(4 * 6, 8)  # four layers' caches, equally spaced in one buffer
    layers = {f"l{i}": LayerCache(buf[i * 6:(i + 1) * 6], "layout", torch.randn(2, 12))
              for i in range(4)}
    before = [lc.scores.clone() for lc in layers.values()]
    (stack,) = LayerStack.build(layers)
    assert stack.scores.shape == (2, 48)
    for i, lc in enumerate(layers.values()):
        assert torch.equal(lc.scores, before[i])
        assert lc.scores.untyped_storage().data_ptr() == stack.scores.untyped_storage().data_ptr()


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_an_auto_sized_cache_and_the_eviction_state_fit_in_vllms_figure(
        policy, fresh_engines, monkeypatch):
    """vLLM's own sizing (no kv_cache_memory_bytes: the worker's resident memory
    after a warm-up, against --gpu-memory-utilization of RAM); 12 requests at
    budget 64 compact while they run. At every step, the KV cache vLLM
    allocated plus every tensor the eviction state holds fit in the figure
    vLLM found, and the state stays within the footprint the cache made room for."""
    import psutil

    from vllm_kvevict.patches import worker_memory
    from vllm_kvevict.integration.worker import worker_state

    total = psutil.virtual_memory().total
    rss = psutil.Process().memory_info().rss
    # About 1 GiB of cache beyond what the engine's own start adds.
    utilization = (rss + (3 << 29)) / total
    monkeypatch.setattr(worker_memory, "last_split", None)  # this engine's, not an earlier one's
    llm = fresh_engines.get(
        kv_cache_memory_bytes=None, gpu_memory_utilization=utilization, max_num_seqs=16,
        max_num_batched_tokens=256,
        additional_config={"kv_eviction": policy, "kv_budget": 64})
    split = worker_memory.last_split
    assert split is not None and split.max_requests == 16
    assert 0 < split.cache < split.available

    state = worker_state()
    seen = {"held": 0, "orders": 0}
    begin = state.begin_step

    def sampled(runner, scheduler_output):
        begin(runner, scheduler_output)
        kv = {t.untyped_storage().data_ptr() for t in runner.kv_caches}
        seen["held"] = max(seen["held"], held_bytes(state, exclude=kv))
        seen["orders"] = max(seen["orders"], len(state.order))

    monkeypatch.setattr(state, "begin_step", sampled)
    from vllm import SamplingParams

    prompts = [p * 6 for p in PROMPTS] * 3  # ~100-250 tokens each, 12 requests
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
                 use_tqdm=False)
    assert seen["orders"] >= 4, "requests compacted while others ran"
    kv_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in state.runner.kv_caches}.values())
    assert kv_bytes <= split.cache
    slots = kv_bytes // split.slot_bytes
    assert 0 < seen["held"] <= split.footprint.bytes(slots, split.max_requests)
    assert kv_bytes + seen["held"] <= split.available


def test_an_explicit_cache_that_leaves_no_room_for_eviction_is_refused(
        fresh_engines, monkeypatch):
    """vLLM checks a cache you size against free memory alone; with eviction on,
    what it holds beside the cache joins that check. Free memory is made to read
    as the cache plus 1 MiB (vLLM's own check passes, eviction's buffers do not
    fit): startup stops naming the flags, before the cache is allocated."""
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo
    from vllm.v1.worker import cpu_worker

    cache = kv_bytes(DTYPE)
    monkeypatch.setattr(cpu_worker, "get_memory_node_info",
                        lambda node=0: MemoryNodeInfo(total_memory=24 << 30,
                                                      available_memory=cache + (1 << 20)))
    with pytest.raises(Exception, match=r"eviction holds beside it \(--kv-eviction h2o"):
        fresh_engines.get(additional_config={"kv_eviction": "h2o", "kv_budget": 64})
