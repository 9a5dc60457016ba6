"""Prompt modules on other engines: eviction (copy-on-write) under h2o and
andpro, preemption. The h2o and andpro engines are the suite's shared
policy engines (conftest.engine_settings; their requests ask for a 64-token
budget of its own); the preemption test has a small pool of its own.
"""

import pytest
import torch
from conftest import engine_settings
from test_prompt_modules import PROMPT, SCHEMA, _ref_counts, read_kv

from vllm_kvevict.integration import prompt_modules as pm
from vllm_kvevict.probe import scheduler_of


@pytest.mark.parametrize("policy", ["andpro", "h2o"])
def test_eviction_copies_shared_blocks_and_never_writes_them(engines, policy):
    """A 64-token budget on a request that imports ~130 shared tokens:
    compaction writes private blocks; the pinned ones keep their KV, and a
    second importer gets exactly the same result. Under h2o the importers'
    scores of the module tokens live in private rows (core/scoring/private_scores.py):
    neither adds its attention at the shared slots, so the second importer,
    finding them as the first left them, computes the same kept sets."""
    from vllm import SamplingParams

    llm = engines.get(**engine_settings(policy))
    manager = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers[0]
    compactions0 = manager.num_compactions
    try:
        pm.register_schema(llm, SCHEMA)
        ids = [b for e in pm.pinned_modules(llm).values() for b in e["block_ids"]]
        before = llm.collective_rpc(read_kv, args=(3, ids))[0]
        if policy == "h2o":
            scores_before = llm.collective_rpc(read_scores, args=(ids,))[0]
        sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                            extra_args={"kv_budget": 64})
        first = llm.generate([PROMPT], sp, use_tqdm=False)[0]
        assert manager.num_compactions > compactions0 and first.num_cached_tokens > 0
        _assert_kv_unchanged(llm, ids, before)
        assert all(r == [1] * len(r) for r in _ref_counts(llm).values())
        second = llm.generate([PROMPT], sp, use_tqdm=False)[0]
        assert second.num_cached_tokens == first.num_cached_tokens
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        _assert_kv_unchanged(llm, ids, before)
        if policy == "h2o":
            assert torch.equal(llm.collective_rpc(read_scores, args=(ids,))[0], scores_before)
        _remove_and_check_pool_whole(llm)
    finally:
        pm.REGISTRY.schemas.pop("people", None)


def _assert_kv_unchanged(llm, ids: list[int], before) -> None:
    for a, b in zip(before, llm.collective_rpc(read_kv, args=(3, ids))[0]):
        assert torch.equal(a, b)


def _remove_and_check_pool_whole(llm) -> None:
    """Remove the test's schema: every block is back in vLLM's pool."""
    pm.remove_schema(llm, "people")
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def read_scores(worker, block_ids: list[int]) -> torch.Tensor:
    """(L, H, N) H2O scores at the slots of `block_ids`, every layer."""
    from vllm_kvevict.integration.worker import worker_state

    layers = list(worker_state().layers.values())
    bs = layers[0].layout.block_size
    slots = torch.tensor([b * bs + o for b in block_ids for o in range(bs)])
    return torch.stack([lc.scores[:, slots].clone() for lc in layers])


def test_preempted_importers_reattach_and_leave_the_pool_whole(engines):
    """A pool too small for all importers at once: vLLM preempts some, and on
    resume they adopt the module blocks again through the same path."""
    from vllm import SamplingParams

    from vllm_kvevict.probe import attach

    llm = engines.get(dtype="float32", kv_cache_memory_bytes=24 << 20, max_model_len=512)
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
        _remove_and_check_pool_whole(llm)
    finally:
        pm.REGISTRY.schemas.pop("people", None)
