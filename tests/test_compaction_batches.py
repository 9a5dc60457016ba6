"""Requests that compact in the same step from the same length to the same
length run as one batch (`WorkerEviction._batches`, `_compact`): rows
(request, layer) in one gather, one kernel call, one selection. The batch must
leave every cache byte, per-slot score, slot order and block row exactly where
compacting the same requests one at a time leaves them, for every policy, on
the compiled CPU kernel's paths and on torch's.

Two layers of one buffer in the CPU backend's layout (bf16, block 32, head
size 64, 3 KV heads, 9 query heads), three requests of 80 tokens:
  1. a and b compact 80 -> 64 (one batch of two; c stays);
  2. a and b grow by 16 tokens in a new block, and all three compact
     80 -> 64 again: one batch mixing requests with a slot order (a, b: holes
     filled in round 1) and without (c).
"""
from types import SimpleNamespace

import pytest
import torch

from test_cpu_kernel import _layout
from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.config.settings import EvictionConfig
from vllm_kvevict.core.eviction.plans import STEP_ATTR, CompactionPlan, EvictionStep
from vllm_kvevict.core.policies import POLICIES, Record
from vllm_kvevict.integration import worker

BS, D, H, HQ, NB = 32, 64, 3, 9, 40
ROWS = {"a": [2, 5, 9], "b": [14, 3, 17], "c": [20, 31, 7]}
NEW_BLOCK = {"a": 33, "b": 34}


def make_state(policy: str):
    """A worker holding a, b and c (80 tokens each, 3 blocks), a random
    cache, random per-slot scores (H2O) and 80 logged queries per request."""
    state = worker.WorkerEviction(EvictionConfig.from_dict({"kv_eviction": policy,
                                                            "kv_budget": 64}), BS)
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(2 * NB, H, BS, 2 * D, generator=gen).to(torch.bfloat16)
    layout = _layout("vec", torch.bfloat16, BS, D, H)
    for i in range(2):
        lc = state.layer(f"l{i}", kv[i * NB:(i + 1) * NB], lambda _: layout)
        lc.scores.copy_(torch.rand(lc.scores.shape, generator=gen))
    state.runner = SimpleNamespace(
        requests={r: SimpleNamespace(block_ids=[list(b)]) for r, b in ROWS.items()},
        input_batch=SimpleNamespace(req_id_to_index={}))
    log_queries(state, list(ROWS), 80, 80, gen)
    return state, kv, gen


def log_queries(state, req_ids, n, seq_len, gen):
    """n new queries per request, ending at logical length seq_len."""
    placement = state.query_window.place(req_ids, [n] * len(req_ids), [seq_len] * len(req_ids))
    for i in range(2):
        q = torch.randn(n * len(req_ids), HQ, D, generator=gen).to(torch.bfloat16)
        state.query_window.record(f"l{i}", q, placement, D ** -0.5)


def plan(req_id: str, src, logical_len: int) -> CompactionPlan:
    return CompactionPlan(req_id, 0, tuple(src), tuple(src[:2]), old_len=80, new_len=64,
                          logical_len=logical_len, recent=32)


def run_step(state, plans, batched: bool):
    """The plans through begin_step: in one step, or one step per plan."""
    for group in [plans] if batched else [[p] for p in plans]:
        out = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[])
        setattr(out, STEP_ATTR, EvictionStep(plans=group))
        state.begin_step(state.runner, out)


def two_rounds(policy: str, batched: bool):
    state, kv, gen = make_state(policy)
    sizes = []
    compact = state._compact
    state._compact = lambda batch: (sizes.append(len(batch)), compact(batch))[1]
    run_step(state, [plan("a", ROWS["a"], 80), plan("b", ROWS["b"], 80)], batched)
    for r in ("a", "b"):
        state.runner.requests[r].block_ids[0].append(NEW_BLOCK[r])
    log_queries(state, ["a", "b"], 16, 96, gen)
    run_step(state, [plan(r, state.runner.requests[r].block_ids[0], 96 if r != "c" else 80)
                     for r in ("a", "b", "c")], batched)
    scores = [lc.scores.clone() for lc in state.layers.values()]
    return kv, scores, state, sizes


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_batch_moves_exactly_what_one_plan_at_a_time_moves(policy, path, monkeypatch):
    if path == "kernel":
        if cpu_kernel.module() is None:
            pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
        monkeypatch.delenv("VLLM_KVEVICT_KERNELS", raising=False)
    else:
        monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    kv1, scores1, one, sizes1 = two_rounds(policy, batched=False)
    kv2, scores2, batch, sizes2 = two_rounds(policy, batched=True)
    assert sizes1 == [1] * 5
    assert sizes2 == [2, 3]  # the batches really formed, order-mixed in round 2
    assert one.num_windowless == batch.num_windowless == 0
    _, untouched, _ = make_state(policy)
    assert not torch.equal(kv1.view(torch.int16), untouched.view(torch.int16))  # KV moved
    assert torch.equal(kv1.view(torch.int16), kv2.view(torch.int16))
    for s1, s2 in zip(scores1, scores2):
        assert torch.equal(s1, s2)
    for r in ROWS:
        assert torch.equal(one.order[r], batch.order[r])
        assert one.runner.requests[r].block_ids == batch.runner.requests[r].block_ids
        assert batch.runner.requests[r].block_ids[0] == ROWS[r][:2]
    if POLICIES[policy].records is Record.QUERIES:  # the window was cut to the recent part
        assert batch.query_window.tail == one.query_window.tail
