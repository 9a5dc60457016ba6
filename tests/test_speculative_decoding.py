"""Speculative decoding (vLLM's n-gram drafts) beside eviction, in a real engine.

A step under speculative decoding writes its token and up to k draft tokens,
and the verifier rejects some drafts: vLLM rolls the request's length back and
the next step writes over their slots. Under eviction three things follow:
  * the planner leaves room in the budget's blocks for the whole step
    (planner.compaction_target, new_tokens), so compaction may come a step
    earlier than without drafts;
  * a rejected draft's query is not the sequence's: H2O's scores and the
    SnapKV/AnDPro window must hold only the accepted ones (the decode log and
    the window log every draft; the worker rolls back the rejected ones before
    anything reads them: WorkerEviction._roll_back_drafts);
  * the KV of rejected drafts is overwritten, never kept.

Proved here, SmolLM2 in float32, block 32, k = 4:
  * H2O with drafts against the dense reference of tests/test_h2o_reference.py,
    fed the engine's compaction points: every (layer, KV head) kept set exact
    and the tokens equal, with drafts proposed, accepted and rejected;
  * within the budget, scored every step, every policy's tokens equal stock
    vLLM's with the same drafts (a child with VLLM_PLUGINS="");
  * over the budget, under every policy, no request holds more than the
    budget's blocks in any decode step by vLLM's own req_to_blocks, and the
    pool is whole after.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process

import pytest
import torch
from conftest import close, close_once, kv_bytes, run_child
from test_h2o_reference import (BLOCK, BUDGET, CHUNK, RECENT, KeptSetChecker, _prompts,
                                _vllm_generate, h2o_generate)

DRAFTS = 4
SPEC = {"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
MAX_TOKENS = 96


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as in test_h2o_reference.py (a shared 2-core box)."""
    old = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(old)


def _engine(model_path, **additional):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # keep the single thread
        engine = LLM(model_path, enforce_eager=True, dtype="float32", block_size=BLOCK,
                     max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                     max_num_batched_tokens=CHUNK, speculative_config=SPEC,
                     additional_config=additional)
    torch._C.set_num_threads(1)
    return engine


@pytest.fixture(scope="module")
def h2o(model_path, engines):
    from vllm_kvevict.integration.worker import worker_state

    engines.close()  # one in-process engine at a time
    engine = _engine(model_path, kv_eviction="h2o", kv_budget=BUDGET, kv_recent=RECENT)
    assert worker_state() is not None, "no in-process worker state: is multiprocessing on?"
    yield engine
    close_once(engine)


@pytest.fixture(scope="module")
def prompts(hf):
    return _prompts(hf[1])


def _drafts():
    from vllm_kvevict.integration.worker import worker_state

    state = worker_state()
    return state.drafts_logged, state.drafts_rejected


@pytest.fixture
def pass_steps(monkeypatch):
    """(drafted, the pass recorded) for each step that took the CPU pass
    (fused_attention.plan returned a FusedStep), seen in this process."""
    from vllm_kvevict.integration import fused_attention

    seen, plan = [], fused_attention.plan

    def spied(builder, state, *args):
        step = plan(builder, state, *args)
        if step is not None:
            seen.append((bool(state.drafts), step.records))
        return step

    monkeypatch.setattr(fused_attention, "plan", spied)
    return seen


@pytest.mark.parametrize("idx", [0, 1, 2])
def test_h2o_with_drafts_matches_dense_reference(h2o, hf, prompts, idx, pass_steps):
    """Also: once a request has evicted, a step with drafts takes the CPU pass
    for attention alone (H2O logs its queries; the pass would score every
    draft), one without drafts takes it for attention and scores."""
    from vllm_kvevict.integration import fused_attention

    model, _ = hf
    prompt = prompts[idx]
    logged0, rejected0 = _drafts()
    got_tokens, snaps, cached = _vllm_generate(h2o, prompt, MAX_TOKENS, salt=f"spec-{idx}")
    if fused_attention.enabled():  # the compiled kernel is there
        assert any(d and not r for d, r in pass_steps), pass_steps
        assert not any(d and r for d, r in pass_steps), pass_steps
    logged, rejected = (a - b for a, b in zip(_drafts(), (logged0, rejected0)))
    assert cached == 0
    assert all(p.new_len == BUDGET - BLOCK for p, _ in snaps)
    schedule = [p.logical_len for p, _ in snaps]

    check = KeptSetChecker(snaps, RECENT)
    ref_tokens, evictions = h2o_generate(model, prompt, MAX_TOKENS, BUDGET, RECENT, BLOCK,
                                         on_evict=check, schedule=schedule)
    print(f"\nprompt {idx}: {len(prompt)} tokens, compactions at L={schedule}, "
          f"drafts logged {logged}, rejected {rejected}; {check.summary()}")
    # Drafts were proposed, and some of them accepted and some rejected.
    assert 0 < rejected < logged, (logged, rejected)
    assert [L for L, _, _ in evictions] == schedule
    assert len(evictions) >= 3, "the test should exercise repeated compactions"
    assert not check.report, "\n".join(check.report[:20])
    assert check.exact == check.total == len(evictions) * 30 * 3, check.summary()
    first_diff = next((i for i, (a, b) in enumerate(zip(got_tokens, ref_tokens)) if a != b),
                      None)
    assert got_tokens == ref_tokens, f"first differing generated token: {first_diff}"


def test_blocks_stay_within_the_budget_and_return_to_the_pool(h2o, prompts):
    """Four requests at once, over budget 64: at every step each holds at most
    the budget's two blocks (vLLM's req_to_blocks), drafts included, and the
    pool is whole once they finish."""
    from vllm import SamplingParams

    from vllm_kvevict.core.eviction.planner import max_blocks_per_request
    from vllm_kvevict.probe import attach

    from decode_blocks import DecodeBlocks

    probe = attach(h2o, DecodeBlocks)
    logged0, _ = _drafts()
    outs = h2o.generate([{"prompt_token_ids": p} for p in [*prompts, prompts[0][:90]]],
                        SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
    assert _drafts()[0] > logged0
    evicted = sum(m.num_tokens_evicted for m in probe.managers())
    assert evicted > 4 * 100
    assert 0 < probe.max_decode_blocks <= max_blocks_per_request(BUDGET, BLOCK)
    assert probe.used_blocks() == 0


def test_prompt_modules_with_drafts_copy_on_write(h2o):
    """Prompt modules under H2O over its budget, with drafts: an importer's
    compactions and its drafts' writes (rejected ones included) go to private
    blocks, never into the pinned module blocks; a second importer gets the
    same tokens; the pool is whole once the schema is removed."""
    from test_prompt_modules import PROMPT, SCHEMA, _ref_counts, read_kv
    from test_prompt_modules_engines import _assert_kv_unchanged, _remove_and_check_pool_whole
    from vllm import SamplingParams

    from vllm_kvevict.integration import prompt_modules as pm
    from vllm_kvevict.probe import full_attention_manager, scheduler_of

    manager = full_attention_manager(scheduler_of(h2o))
    try:
        pm.register_schema(h2o, SCHEMA)
        ids = [b for e in pm.pinned_modules(h2o).values() for b in e["block_ids"]]
        before = h2o.collective_rpc(read_kv, args=(3, ids))[0]
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        compactions0, (logged0, rejected0) = manager.num_compactions, _drafts()
        first = h2o.generate([PROMPT], sp, use_tqdm=False)[0]
        assert manager.num_compactions > compactions0 and first.num_cached_tokens > 0
        logged, rejected = (a - b for a, b in zip(_drafts(), (logged0, rejected0)))
        assert 0 < rejected < logged, (logged, rejected)
        _assert_kv_unchanged(h2o, ids, before)
        second = h2o.generate([PROMPT], sp, use_tqdm=False)[0]
        assert second.num_cached_tokens == first.num_cached_tokens
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        _assert_kv_unchanged(h2o, ids, before)
        assert all(r == [1] * len(r) for r in _ref_counts(h2o).values())
        _remove_and_check_pool_whole(h2o)
    finally:
        pm.REGISTRY.schemas.pop("people", None)


def test_prompt_modules_with_drafts_match_dense_reference(model_path, hf):
    """A module prompt under H2O with drafts, its budget just past what its
    drafts can reach (scored every step, nothing evicted): the tokens are the
    dense Prompt Cache computation's (tests/test_prompt_modules.py), the module
    tokens come from the pinned blocks, and drafts were accepted and rejected
    (in the module's child: `_plugin_runs`)."""
    from test_prompt_modules import dense_reference, expected_layout

    model, tok = hf
    _, ids, positions, segment = expected_layout(tok)
    [got], stats = _plugin_runs(model_path, tok)["modules", "h2o"]
    assert stats["num_cached"] == [sum(i >= 0 for i in segment)], stats
    assert stats["evicted"] == 0 and stats["used_after"] == 0, stats
    assert 0 < stats["drafts_rejected"] < stats["drafts_logged"], stats
    assert stats["score_sum"] > 0, stats
    assert got == dense_reference(model, ids, positions, segment, MODULE_TOKENS)


def test_an_engine_starts_after_an_ngram_engine_in_the_same_process(h2o, model_path):
    """vLLM 0.32's kernel dispatcher scans every module at engine start and
    tripped on llvmlite's library wrapper, which the n-gram proposer's numba
    import loads: after one n-gram engine no other engine started in the
    process (the suite's xdist workers failed every later engine).
    patches/dispatcher_scan.py: a plain engine starts after this module's."""
    from vllm import SamplingParams

    import llvmlite.binding.ffi  # noqa: F401  (loaded by the n-gram engine: the trap is set)

    from vllm import LLM

    close_once(h2o)
    engine = LLM(model_path, enforce_eager=True, dtype="float32", block_size=BLOCK,
                 max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0)
    try:
        [out] = engine.generate(["One, two,"], SamplingParams(temperature=0, max_tokens=4),
                                use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
    finally:
        close(engine)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "andpro", "streaming"])
def test_scored_within_budget_with_drafts_is_token_identical_to_stock(model_path, hf, policy):
    """Each request's budget is just past what its drafts can reach
    (prompt + max_tokens + k - 1 tokens): it may compact, so every step is
    scored (H2O's decode log, the window's ring), drafts rolled back, but no
    step takes it past its blocks and nothing is evicted. The tokens must be
    stock vLLM's with the same n-gram drafts (both from children:
    `_plugin_runs`, `_stock_with_drafts`)."""
    ours, stats = _plugin_runs(model_path, hf[1])["within", policy]
    assert stats["evicted"] == 0, stats
    if policy != "streaming":  # (which records nothing, so logs no draft)
        assert 0 < stats["drafts_rejected"] < stats["drafts_logged"], stats
    if policy == "h2o":
        assert stats["score_sum"] > 0, stats
    if policy in ("snapkv", "andpro"):
        assert stats["window_rows"] > 0, stats
    assert ours == _stock_with_drafts(model_path, WITHIN_TOKENS,
                                      {"prompts": WITHIN_TEXTS, "speculative_config": SPEC})


@pytest.mark.parametrize("policy", ["snapkv", "andpro", "streaming"])
def test_window_policies_with_drafts_over_the_budget_free_their_blocks(model_path, hf, policy):
    """The other policies over a budget of 64 (two blocks) with drafts: every
    request compacts, none holds more than the budget's blocks in a decode
    step (vLLM's req_to_blocks), the rejected drafts leave the window, and
    the pool is whole after (in the module's child: `_plugin_runs`)."""
    from vllm_kvevict.core.eviction.planner import max_blocks_per_request

    ids, stats = _plugin_runs(model_path, hf[1])["over", policy]
    assert [len(x) for x in ids] == [OVER_TOKENS] * len(OVER_TEXTS)
    assert stats["evicted"] >= len(OVER_TEXTS) * (OVER_TOKENS - BUDGET), stats
    assert 0 < stats["max_decode_blocks"] <= max_blocks_per_request(BUDGET, BLOCK), stats
    assert stats["used_after"] == 0, stats
    if policy != "streaming":  # (which records nothing, so logs no draft)
        assert 0 < stats["drafts_rejected"] < stats["drafts_logged"], stats


# The children's cases: within the budget (every policy, token identity with
# stock), over it (the window policies, blocks), and a module prompt (H2O).
WITHIN_TEXTS = ["Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape.",
                "Write a Python function that sorts a list with merge sort, then test it."]
WITHIN_TOKENS = 80
OVER_TEXTS = ["Repeat this list three times: apple, banana, cherry, date, elderberry, fig.",
              "Write a Python function that sorts a list with merge sort, then test it.",
              "Count from one to fifty in words, separated by commas."]
OVER_TOKENS = 160
MODULE_TOKENS = 48

_PLUGIN: dict = {}
_STOCK: dict = {}


def _plugin_runs(model_path: str, tok) -> dict:
    """{(case, policy): (token ids, stats)} of every plugin case, from one
    child (tests/plugin_speculative.py) that builds their engines one after
    another; run once, by the first test that asks."""
    if not _PLUGIN:
        from test_prompt_modules import PROMPT, SCHEMA, expected_layout

        def case(policy, prompts, budgets, n, **extra):
            return dict(policy=policy, prompts=prompts, budgets=budgets, max_tokens=n,
                        speculative_config=SPEC, **extra)

        within = [len(tok(t)["input_ids"]) + WITHIN_TOKENS + DRAFTS - 1 for t in WITHIN_TEXTS]
        cases = {("within", p): case(p, WITHIN_TEXTS, within, WITHIN_TOKENS)
                 for p in ("h2o", "snapkv", "andpro", "streaming")}
        cases.update({("over", p): case(p, OVER_TEXTS, [BUDGET] * len(OVER_TEXTS), OVER_TOKENS)
                      for p in ("snapkv", "andpro", "streaming")})
        # Last: its schema stays registered in the child's frontend.
        module_ids = expected_layout(tok)[1]
        cases["modules", "h2o"] = case("h2o", [PROMPT],
                                       [len(module_ids) + MODULE_TOKENS + DRAFTS - 1],
                                       MODULE_TOKENS, schema=SCHEMA)
        runs = run_child("plugin_speculative.py", [model_path, kv_bytes("float32")],
                         list(cases.values()), "RUNS=", timeout=1800)
        _PLUGIN.update({k: (r["ids"], r["stats"]) for k, r in zip(cases, runs)})
    return _PLUGIN


def _stock_with_drafts(model_path: str, n: int, payload: dict) -> list:
    """Stock vLLM's tokens for `payload` with its drafts (a child, once per
    payload: every policy's case compares with the same run)."""
    import json

    key = json.dumps([model_path, n, payload], sort_keys=True)
    if key not in _STOCK:
        _STOCK[key] = run_child("stock_speculative.py",
                                [model_path, n, "float32", kv_bytes("float32")], payload, "IDS=")
    return _STOCK[key]
