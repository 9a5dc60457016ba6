"""Issue 20 #1-2: compaction never reads a block it has already written, and
never runs with two views of a request's blocks.

#1  A shared kept block gets a private copy. In a full pool that copy used to be
    the request's own just-freed tail block, which still held the recent window
    the in-place Triton kernel had yet to move: the scheduler must hand out a
    block no source uses, and the launcher refuses a plan that breaks that.
#2  A plan whose request the worker does not know fails loudly (the scheduler
    has already freed the request's tail); the legitimate cases are handled.

Pure torch / scheduler objects: no engine. Triton runs in its interpreter
(conftest turns TRITON_INTERPRET on before anything imports triton).
"""
import importlib
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.block_pool import BlockPool

from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
from vllm_kvevict.core.eviction.plans import STEP_ATTR, CompactionPlan, EvictionStep
from vllm_kvevict.integration import worker
from vllm_kvevict.integration.spec import EvictableAttentionManager, EvictableAttentionSpec
from vllm_kvevict.triton_kernels.reference import compact_ref

BS, H, D = 16, 2, 32


def nhd_cache(num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, H, BS, 2 * D, generator=g)
    layout = NHDLayout.for_cache(kv)
    return layout, *layout.split(kv)


def slots(blocks, n):
    pos = torch.arange(n)
    return blocks[:, pos // BS] * BS + pos % BS


# --- 1a. the launcher refuses a plan that breaks its in-place precondition ----------

def test_triton_compaction_refuses_dst_that_is_another_src_slot():
    cmp = importlib.import_module("vllm_kvevict.triton_kernels.compaction")
    # The plan: src blocks [0..6], block 0 shared -> its private copy is
    # block 6, the newest tail block, which still holds the recent window.
    src_blocks, dst_blocks = torch.tensor([[0, 1, 2, 3, 4, 5, 6]]), torch.tensor([[6, 1, 2, 3]])
    old_len, new_len = 7 * BS, 4 * BS
    keep = torch.cat([torch.arange(2 * BS), torch.arange(old_len - 2 * BS, old_len)])
    keep = keep.expand(1, H, new_len).contiguous()  # sink + the recent window
    src, dst = slots(src_blocks, old_len), slots(dst_blocks, 4 * BS)
    _, kc, vc = nhd_cache(8)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="in-place precondition"):
        cmp.compact_in_place(kc, vc, None, src, dst, keep)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # nothing launched

    # What the kernel would have written: the reference (read first) is right.
    layout, kt, vt = nhd_cache(8)
    compact_ref(layout, kt, vt, None, src, dst, keep)
    want = before[0][:7].reshape(-1, H, D)[keep[0, 0]]
    assert torch.equal(kt[dst_blocks[0]].reshape(-1, H, D), want)

    # Still accepted: in place (dst = src's first blocks), a private copy of a
    # shared block from outside the sources, and a second row with its own blocks.
    ok_dst = torch.tensor([[7, 1, 2, 3]])
    cmp.compact_in_place(kc, vc, None, src, slots(ok_dst, 4 * BS), keep)
    cmp.compact_in_place(kc, vc, None, src, slots(src_blocks[:, :4], 4 * BS), keep)
    # Checked per row (rows are layers: each has its own blocks): a dst block
    # that is one of its own row's sources at another index is refused.
    src2 = torch.cat([slots(torch.tensor([[0, 1]]), 2 * BS), slots(torch.tensor([[4, 5]]), 2 * BS)])
    keep2 = torch.arange(BS).expand(2, H, BS).contiguous()
    cmp.compact_in_place(kc, vc, None, src2, slots(torch.tensor([[7], [4]]), BS), keep2)
    with pytest.raises(ValueError, match="in-place precondition"):
        cmp.compact_in_place(kc, vc, None, src2, slots(torch.tensor([[0], [5]]), BS), keep2)


# --- 1b. the scheduler never hands out a source block as a private copy -------------

def manager(num_blocks, budget=5 * BS):  # a 5-block cap: compactions keep 4
    cfg = EvictionConfig.from_dict({"kv_eviction": "streaming", "kv_budget": budget})
    spec = EvictableAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D,
                                  dtype=torch.float32,
                                  eviction=cfg)
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BS)
    return EvictableAttentionManager(spec, block_pool=pool, enable_caching=True,
                                     kv_cache_group_id=0, scheduler_block_size=BS)


def setup_shared(m, spare):
    """Request "a" holds 7 full blocks; "b" shares a's first (a kept block:
    copy-on-write); "fill" takes the pool but `spare` free blocks."""
    pool = m.block_pool
    a = pool.get_new_blocks(7)
    m.req_to_blocks["a"] = list(a)
    pool.touch([a[0]])  # "b" reads it too
    m.req_to_blocks["b"] = [a[0]]
    m.req_to_blocks["fill"] = pool.get_new_blocks(pool.get_num_free_blocks() - spare)
    assert pool.get_num_free_blocks() == spare
    return a


def assert_in_place_safe(plan):
    for i, d in enumerate(plan.dst_block_ids):
        assert d == plan.src_block_ids[i] or d not in plan.src_block_ids, plan


def test_full_pool_shared_kept_block_never_gets_a_source_block():
    m = manager(1 + 7 + 2)  # block 0 is vLLM's null block
    a = setup_shared(m, spare=0)
    m.remove_skipped_blocks("a", 7 * BS, num_prompt_tokens=10)  # decode, 112 >= the budget, 80
    for plan in m.pending:
        assert_in_place_safe(plan)
    # No block can be private: nothing happens now (retried next step, when a
    # block is free or "b" let go), and the request still holds all it had.
    assert m.pending == [] and m.req_to_blocks["a"] == a and m.evicted == {}
    assert m.block_pool.get_num_free_blocks() == 0 and a[0].ref_cnt == 2


def test_one_free_block_is_the_private_copy_and_the_tail_is_freed():
    m = manager(1 + 7 + 3)
    a = setup_shared(m, spare=1)
    spare = m.block_pool.free_block_queue.get_all_free_blocks()[0]
    m.remove_skipped_blocks("a", 7 * BS, num_prompt_tokens=10)
    (plan,) = m.pending
    assert_in_place_safe(plan)
    assert plan.src_block_ids == tuple(b.block_id for b in a)
    assert plan.dst_block_ids == (spare.block_id, *plan.src_block_ids[1:4])
    assert (plan.old_len, plan.new_len) == (7 * BS, 4 * BS)
    assert a[0].ref_cnt == 1  # "b" keeps the shared block, "a" let go of it
    assert m.block_pool.get_num_free_blocks() == 3  # the tail, back in the pool
    assert m.evicted == {"a": 3 * BS}


def test_no_plan_for_a_finished_request():
    """vLLM calls remove_skipped_blocks from _connector_finished for a request it
    is finishing (offload configures a KV connector): that is no compaction point."""
    m = manager(1 + 7 + 3)
    a = setup_shared(m, spare=1)
    m.requests = {"a": SimpleNamespace(is_finished=lambda: True, sampling_params=None)}
    m.remove_skipped_blocks("a", 7 * BS, num_prompt_tokens=10)
    assert m.pending == [] and m.req_to_blocks["a"] == a and m.num_compactions == 0


# --- 2. the worker fails closed on a plan for a request it does not hold ------------

def worker_with_cache(requests):
    state = worker.WorkerEviction(EvictionConfig.from_dict({"kv_eviction": "streaming",
                                                            "kv_budget": 2 * BS}), BS)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(8, H, BS, 2 * D, generator=g)
    state.layer("l0", kv, NHDLayout.for_cache)
    state.runner = SimpleNamespace(requests=requests,
                                   input_batch=SimpleNamespace(req_id_to_index={}))
    return state, kv


def step(plans, finished=(), new=()):
    out = SimpleNamespace(finished_req_ids=set(finished),
                          scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new])
    setattr(out, STEP_ATTR, EvictionStep(plans=plans, evicted={p.req_id: p.old_len - p.new_len
                                                               for p in plans}))
    return out


def plan(req_id="x"):
    return CompactionPlan(req_id, 0, (3, 5, 1), (3, 5), old_len=40, new_len=2 * BS,
                          logical_len=40, recent=BS)


def test_plan_for_unknown_request_raises(monkeypatch):
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    state, kv = worker_with_cache({})
    before = kv.clone()
    with pytest.raises(RuntimeError, match=r"'x'.*already freed"):
        state.begin_step(state.runner, step([plan("x")]))
    assert torch.equal(kv, before)


def test_plan_without_registered_layers_raises():
    state = worker.WorkerEviction(EvictionConfig.from_dict({"kv_eviction": "streaming",
                                                            "kv_budget": 2 * BS}), BS)
    state.runner = SimpleNamespace(requests={"x": SimpleNamespace(block_ids=[[3, 5, 1]])},
                                   input_batch=SimpleNamespace(req_id_to_index={}))
    with pytest.raises(RuntimeError, match="'x'"):
        state.begin_step(state.runner, step([plan("x")]))


def test_plans_of_known_finished_and_new_requests(monkeypatch):
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    row = [3, 5, 1]
    state, kv = worker_with_cache({"x": SimpleNamespace(block_ids=[row])})
    before = kv.clone()
    # A request that this step also finishes: the runner drops it next, its
    # blocks are not ours to write.
    state.begin_step(state.runner, step([plan("x")], finished=["x"]))
    assert torch.equal(kv, before) and row == [3, 5, 1]
    # New to this worker this step (e.g. its KV came from a connector): the KV
    # moves; its row arrives with this step's output, already the plan's dst.
    state.begin_step(state.runner, step([plan("y")], new=["y"]))
    assert not torch.equal(kv, before) and row == [3, 5, 1]
    # The normal case: the KV moves and the worker's row becomes dst.
    state.begin_step(state.runner, step([plan("x")]))
    assert row == [3, 5]
