"""Prompt modules on engines of their own: eviction (copy-on-write), preemption,
an engine that refuses modules. Each test starts and closes its engine; they
live apart from test_prompt_modules.py, whose engine is shared by its module
(closing an engine tears down vLLM's process-wide groups under another).
"""

import pytest
import torch
from conftest import close, make_llm
from test_prompt_modules import PROMPT, SCHEMA, _ref_counts, read_kv

from vllm_kvevict.integration import prompt_modules as pm
from vllm_kvevict.integration.probe import scheduler_of


def test_h2o_engine_refuses_modules(model_path):
    from vllm_kvevict.pml import PMLError

    llm = make_llm(model_path, additional_config={"kv_eviction": "h2o", "kv_budget": 64})
    try:
        with pytest.raises(PMLError, match="h2o"):
            pm.register_schema(llm, SCHEMA)
    finally:
        close(llm)


def test_eviction_copies_shared_blocks_and_never_writes_them(model_path):
    """AnDPro at a 64-token budget on a request that imports ~130 shared tokens:
    compaction writes private blocks; the pinned ones keep their KV, and a
    second importer gets exactly the same result."""
    from vllm import SamplingParams

    llm = make_llm(model_path, dtype="float32",
                   additional_config={"kv_eviction": "andpro", "kv_budget": 64})
    try:
        pm.register_schema(llm, SCHEMA)
        pinned = pm.pinned_modules(llm)
        ids = [b for e in pinned.values() for b in e["block_ids"]]
        before = llm.collective_rpc(read_kv, args=(3, ids))[0]
        sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        first = llm.generate([PROMPT], sp, use_tqdm=False)[0]
        manager = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers[0]
        assert manager.num_compactions > 0 and first.num_cached_tokens > 0
        after = llm.collective_rpc(read_kv, args=(3, ids))[0]
        for a, b in zip(before, after):
            assert torch.equal(a, b)
        assert all(r == [1] * len(r) for r in _ref_counts(llm).values())
        second = llm.generate([PROMPT], sp, use_tqdm=False)[0]
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        pm.remove_schema(llm, "people")
        pool = scheduler_of(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    finally:
        pm.REGISTRY.schemas.pop("people", None)
        close(llm)


def test_preempted_importers_reattach_and_leave_the_pool_whole(model_path):
    """A pool too small for all importers at once: vLLM preempts some, and on
    resume they adopt the module blocks again through the same path."""
    from vllm import SamplingParams

    from vllm_kvevict.integration.probe import attach

    llm = make_llm(model_path, dtype="float32", kv_cache_memory_bytes=24 << 20, max_model_len=512)
    try:
        pm.register_schema(llm, SCHEMA)
        probe = attach(llm)
        prompts = [f'<prompt schema="people"><alice/><bob/>Question {i}: tell me more.</prompt>'
                   for i in range(8)]
        sp = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert probe.preemptions > 0
        assert all(len(o.outputs[0].token_ids) == 160 and o.num_cached_tokens > 0 for o in outs)
        assert all(r == [1] * len(r) for r in _ref_counts(llm).values())
        pm.remove_schema(llm, "people")
        pool = scheduler_of(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    finally:
        pm.REGISTRY.schemas.pop("people", None)
        close(llm)
