"""Hybrid models: eviction in the full-attention layers, the sliding-window
layers left to vLLM.

Models such as Gemma 3 or gpt-oss interleave sliding-window layers (each query
sees the newest W positions; vLLM's hybrid KV cache manager gives them a KV
cache group of their own and frees the blocks that leave the window) with
full-attention layers, whose KV grows with the context. The plugin compacts
the full-attention group only. The model here is SmolLM2 with its even layers
made sliding-window through its config's `layer_types` (window 48;
`python -m vllm_kvevict.models smollm2-hybrid`): real weights, a real vLLM
engine with two KV cache groups.

  * H2O on it equals the dense reference of tests/test_h2o_reference.py, whose
    windowed layers see their window and never evict: every kept set of every
    full-attention (layer, KV head), and the greedy tokens, in float32.
  * budget >= length, every step scored: token-identical to stock vLLM on the
    same model.
  * blocks, by vLLM's req_to_blocks: the full-attention group holds at most
    the budget's blocks, the window group its window's; the pool is whole after.
  * refused at startup: the hybrid manager turned off (windowed layers in the
    full-attention group), a model whose every layer is windowed.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process

import pytest
import torch
from conftest import close, close_once, kv_bytes, run_child
from test_h2o_reference import (  # noqa: F401  (fixture one_thread)
    BLOCK, BUDGET, CHUNK, MAX_TOKENS, PREFILL, RECENT, DenseH2O, KeptSetChecker, _prompts,
    _vllm_generate, h2o_generate, one_thread)

from vllm_kvevict.core.eviction.planner import max_blocks_per_request
from vllm_kvevict.models import HYBRID_WINDOW, hybrid_of

WINDOW = HYBRID_WINDOW  # 48 < BUDGET: the windowed layers see less than the evicting ones keep
WINDOWED = [li % 2 == 0 for li in range(30)]  # SmolLM2's 30 layers: even ones windowed


@pytest.fixture(scope="module")
def hybrid_path(model_path):
    from vllm_kvevict.models import ensure_smollm2_hybrid

    return ensure_smollm2_hybrid()


def _engine(path: str, **kwargs):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # keep the single thread
        return LLM(path, enforce_eager=True, dtype="float32", block_size=BLOCK,
                   max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                   max_num_batched_tokens=CHUNK, **kwargs)


H2O = {"kv_eviction": "h2o", "kv_budget": BUDGET, "kv_recent": RECENT}


@pytest.fixture(scope="module")
def llm(hybrid_path, engines):
    from vllm_kvevict.integration.worker import worker_state

    engines.close()  # one in-process engine at a time
    engine = _engine(hybrid_path, additional_config=H2O)
    torch._C.set_num_threads(1)
    assert worker_state() is not None, "no in-process worker state: is multiprocessing on?"
    yield engine
    close_once(engine)


def _groups(llm):
    from vllm_kvevict.probe import scheduler_of

    return scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers


def test_the_engine_keeps_windowed_layers_apart(llm):
    """Two KV cache groups: ours (evictable) with the 15 full-attention layers,
    vLLM's sliding-window manager with the 15 others; only ours registers
    layers with the worker's eviction state. A schema of prompt modules is
    refused: the windowed layers cannot keep a module's KV whole."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from vllm_kvevict.core.modules.pml import PMLError
    from vllm_kvevict.integration import prompt_modules as pm
    from vllm_kvevict.integration.spec import EvictableAttentionManager
    from vllm_kvevict.integration.worker import worker_state

    kinds = sorted(type(m).__name__ for m in _groups(llm))
    assert kinds == sorted([EvictableAttentionManager.__name__, SlidingWindowManager.__name__])
    out = llm.generate(["Name three rivers."], _greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    layers = [int(n.split(".")[2]) for n in worker_state().layers]
    assert layers == [li for li, w in enumerate(WINDOWED) if not w]
    # Prompt modules are refused with the reason (ModuleStore.problem), pinning nothing.
    with pytest.raises(PMLError, match="sliding-window layers"):
        pm.register_schema(llm, '<schema name="s"><module name="m">' + "word " * 80
                           + "</module></schema>")
    assert pm.pinned_modules(llm) == {}


def _greedy(n, **extra):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra)


@pytest.mark.parametrize("idx,prefill,cpu_pass", [(0, "end", "on"), (2, "chunks", "on"),
                                                  (1, "end", "off")])
def test_h2o_on_a_hybrid_model_matches_dense_reference(llm, hf, idx, prefill, cpu_pass,
                                                       monkeypatch):
    """As test_h2o_reference.py's test, the reference's even layers windowed:
    had the engine evicted in a windowed layer, or its windowed layers seen
    other positions than the newest 48 (the full-attention layers' inputs, and
    so their scores, would change), a kept set or a token would differ. With
    the CPU attention pass off (VLLM_KVEVICT_CPU_FUSED=off) H2O's scores come
    from the query logs, flushed into the full-attention group's blocks (not
    the window group's, which is group 0 here)."""
    from vllm_kvevict.integration import fused_attention
    from vllm_kvevict.integration.worker import worker_state

    model, tok = hf
    prompt = _prompts(tok)[idx]
    extra, chunk = PREFILL[prefill]
    monkeypatch.setenv("VLLM_KVEVICT_CPU_FUSED", cpu_pass)
    steps = worker_state().cpu_pass_steps
    got_tokens, snaps, cached = _vllm_generate(llm, prompt, MAX_TOKENS, extra,
                                               salt=f"hybrid-{idx}-{prefill}")
    assert cached == 0
    in_pass = worker_state().cpu_pass_steps - steps
    assert in_pass > 0 if cpu_pass == "on" and fused_attention.enabled() else in_pass == 0
    check = KeptSetChecker(snaps, RECENT)
    ref_tokens, evictions = h2o_generate(
        model, prompt, MAX_TOKENS, BUDGET, RECENT, BLOCK, chunk=chunk, on_evict=check,
        make_ref=lambda m, n: DenseH2O(m, n, windowed=WINDOWED, window=WINDOW))
    print(f"\nprompt {idx} ({prefill}, pass {cpu_pass}: {in_pass} steps): {len(prompt)} tokens, compactions at "
          f"L={[L for L, _, _ in evictions]}, {check.summary()}")
    assert [p.logical_len for p, _ in snaps] == [L for L, _, _ in evictions]
    assert len(evictions) >= 2, "the test should exercise repeated compactions"
    assert not check.report, "\n".join(check.report[:20])
    # 15 full-attention layers x 3 KV heads per compaction, every one exact.
    assert check.exact == check.total == len(evictions) * 15 * 3, check.summary()
    assert got_tokens == ref_tokens


def test_each_group_holds_its_bound_and_the_pool_is_whole_after(llm, hf):
    """Four requests at once, 150-200-token prompts and 120 tokens each: by
    vLLM's own req_to_blocks, the evictable group never holds more than the
    budget's blocks per request once decoding, the sliding-window group never
    more than its window's (vLLM's manager drops the rest: null blocks), and
    every block is back in vLLM's BlockPool afterwards."""
    from vllm_kvevict.probe import BlockProbe, attach
    from vllm_kvevict.integration.spec import EvictableAttentionManager

    class PerGroup(BlockProbe):
        def __init__(self, scheduler) -> None:
            super().__init__(scheduler)
            self.peak: dict[str, int] = {}

        def sample(self, output) -> None:
            super().sample(output)
            for m in self.managers():
                for rid, blocks in m.req_to_blocks.items():
                    req = self.scheduler.requests.get(rid)
                    # After schedule() num_computed_tokens counts this step's
                    # tokens: a step that ends the prompt may hold it whole.
                    if req is None or req.num_computed_tokens <= req.num_prompt_tokens:
                        continue
                    held = sum(not b.is_null for b in blocks)
                    key = "full" if isinstance(m, EvictableAttentionManager) else "window"
                    self.peak[key] = max(self.peak.get(key, 0), held)

    _, tok = hf
    prompts = [{"prompt_token_ids": p} for p in _prompts(tok)] + [
        {"prompt_token_ids": _prompts(tok)[0][::-1]}]
    probe = attach(llm, PerGroup)
    evicted0 = sum(getattr(m, "num_tokens_evicted", 0) for m in _groups(llm))
    outs = llm.generate(prompts, _greedy(120), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 120 for o in outs)
    evicted = sum(getattr(m, "num_tokens_evicted", 0) for m in _groups(llm)) - evicted0
    assert evicted >= 4 * 150, evicted
    assert 0 < probe.peak["full"] <= max_blocks_per_request(BUDGET, BLOCK), probe.peak
    # The window's blocks plus the one the next token goes to.
    assert 0 < probe.peak["window"] <= -(-WINDOW // BLOCK) + 1, probe.peak
    assert probe.used_blocks() == 0


@pytest.mark.parametrize("kind", ["snapkv", "andpro"])
def test_window_policies_on_a_hybrid_model_match_dense_reference(llm, hf, kind):
    """SnapKV and AnDPro as test_window_reference.py checks them (the same
    floors of exact kept sets: their float32 window scores differ from the
    reference's in the last bits, which can swap near-ties), on the hybrid
    model against the reference with its windowed layers."""
    from test_window_reference import BUDGET as WINDOW_BUDGET
    from test_window_reference import EXACT_FLOOR, dense_window
    from test_window_reference import WINDOW as QUERY_WINDOW

    model, tok = hf
    close_once(llm)  # one in-process engine at a time: the module's is done by now
    prompt = _prompts(tok)[2]
    engine = _engine(llm_path(llm), additional_config={
        "kv_eviction": kind, "kv_budget": WINDOW_BUDGET, "kv_window": QUERY_WINDOW})
    try:
        got_tokens, snaps, _ = _vllm_generate(engine, prompt, MAX_TOKENS, salt=kind)
    finally:
        close(engine)
    window_ref = dense_window(kind)
    check = KeptSetChecker(snaps, QUERY_WINDOW)
    ref_tokens, evictions = h2o_generate(
        model, prompt, MAX_TOKENS, WINDOW_BUDGET, QUERY_WINDOW, BLOCK, on_evict=check,
        make_ref=lambda m, n: window_ref(m, n, windowed=WINDOWED, window=WINDOW))
    print(f"\n{kind}: compactions at L={[L for L, _, _ in evictions]}: {check.summary()}")
    assert [p.logical_len for p, _ in snaps] == [L for L, _, _ in evictions]
    assert len(evictions) >= 3 and check.total == len(evictions) * 15 * 3
    assert not check.report, "\n".join(check.report[:20])
    assert check.exact >= EXACT_FLOOR[kind] * check.total, check.summary()
    assert got_tokens == ref_tokens


def llm_path(llm) -> str:
    return llm.llm_engine.vllm_config.model_config.model


def test_scored_within_budget_is_token_identical_to_stock(llm, hybrid_path):
    """Each request's budget one token under its final length (an engine at
    --kv-budget 256): every step is scored (H2O's scores grow in every
    full-attention layer), nothing is evicted, and the tokens equal stock
    vLLM's on the same hybrid model (a child with VLLM_PLUGINS=""), float32."""
    from vllm_kvevict.integration.worker import worker_state

    close_once(llm)  # one in-process engine at a time: the module's is done by now
    prompts = ["Write a detailed story about a lighthouse keeper who finds a message.",
               "The GNU General Public License is a free, copyleft license for software "
               "and other kinds of works. Summarize what copyleft means, and why."]
    n = 100  # > WINDOW past the prompt: the windowed layers slide
    engine = _engine(hybrid_path, additional_config={"kv_eviction": "h2o", "kv_budget": 256})
    try:
        tok = engine.get_tokenizer()
        params = [_greedy(n, extra_args={"kv_budget": len(tok(p)["input_ids"]) + n - 1})
                  for p in prompts]
        ours = [list(o.outputs[0].token_ids)
                for o in engine.generate(prompts, params, use_tqdm=False)]
        assert sum(getattr(m, "num_tokens_evicted", 0) for m in _groups(engine)) == 0
        layers = worker_state().layers.values()
        assert len(layers) == 15 and all(float(lc.scores.abs().sum()) > 0 for lc in layers)
    finally:
        close(engine)
    stock = run_child("stock_generate.py", [hybrid_path, n, BLOCK, "float32",
                                            kv_bytes("float32")], prompts, "IDS=")
    assert ours == stock


@pytest.mark.parametrize("case", ["hybrid manager off", "every layer windowed"])
def test_what_eviction_cannot_serve_is_refused_at_startup(llm, hybrid_path, model_path,
                                                          tmp_path, case):
    # (after the module's other tests: `llm` is requested only to be closed)
    """Windowed layers in the full-attention group would read their window over
    compacted slots; a model of windowed layers only has nothing to evict.
    Both stop at startup with the reason (not a silent stock run)."""
    close_once(llm)  # one in-process engine at a time: the module's is done by now
    if case == "hybrid manager off":
        path, kwargs, says = hybrid_path, {"disable_hybrid_kv_cache_manager": True}, \
            "drop --disable-hybrid-kv-cache-manager"
    else:
        path, kwargs, says = hybrid_of(model_path, tmp_path / "m", [True] * 30, WINDOW), {}, \
            "nothing to evict"
    with pytest.raises(Exception, match=says):
        engine = _engine(path, additional_config=H2O, **kwargs)
        close(engine)


def test_serve_a_hybrid_model_with_eviction(hybrid_path):
    """`vllm serve HYBRID --kv-eviction h2o --kv-budget 64` with the prompt-module
    routes: three concurrent completions over the budget served in full;
    /metrics counts the compactions and evicted tokens (the scheduler's
    counters come from the full-attention group, group 1 here: read from
    group 0 they were missing); a schema is refused with the reason (a module's
    KV cannot be kept whole in windowed layers) and leaves nothing pinned;
    every block is back in the pool afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from conftest import PROMPTS

    from vllm_kvevict.eval.server import Server

    schema = ('<schema name="city">You are a guide.<module name="paris">Paris is the '
              'capital of France. The Louvre, the largest art museum in the world, '
              'stands on the right bank of the Seine.</module></schema>')
    with Server(hybrid_path, "--kv-eviction", "h2o", "--kv-budget", "64",
                env={"VLLM_PLUGINS": "kvevict,kvevict_modules"}) as srv:
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda p: srv.complete(p, max_tokens=120, ignore_eos=True),
                                    PROMPTS[:3]))
        for r in replies:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 120
        r = requests.post(srv.url + "/v1/kvevict/schemas", json={"pml": schema}, timeout=60)
        assert r.status_code == 400 and "sliding-window" in r.text, r.text
        m = srv.wait_idle()
        assert m["vllm_kvevict_compactions_total"] >= 3 * 2, m
        assert m["vllm_kvevict_tokens_evicted_total"] >= 3 * 64, m
        usage = [v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc{")]
        assert usage == [0.0], usage
