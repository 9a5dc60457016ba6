"""The real engine: SmolLM2-135M through vLLM with the plugin, checked through
vLLM's own block pool.

One engine per policy serves most tests (conftest.Engines): its server budget
(256) is at least every identity prompt's length, and the tests that evict ask
for less per request (`extra_args={"kv_budget": 64}`), as a user of a server
would. Counters read from vLLM's KV managers are cumulative over the engine's
life, so tests compare them before and after their own requests.
"""

import pytest
from conftest import (
    DTYPE,
    PROMPTS,
    SERVER_BUDGET,
    STOCK_TOKENS,
    close,
    engine_settings,
    make_llm,
    stock_ids,
)
from kept_positions import KeptRecorder

from vllm_kvevict.core.eviction.planner import max_blocks_per_request
from vllm_kvevict.core.policies import POLICIES, Record

H2O = engine_settings("h2o")
# Every registered policy, and those that record something every step.
RECORDING = [name for name, p in POLICIES.items() if p.records is not Record.NOTHING]
WINDOWED = [name for name, p in POLICIES.items() if p.records is Record.QUERIES]


def greedy(max_tokens, budget=None, **kw):
    from vllm import SamplingParams

    if budget is not None:
        kw["extra_args"] = {"kv_budget": budget}
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def totals(probe) -> tuple[int, int]:
    """(tokens evicted, compactions) so far, summed over vLLM's KV managers."""
    managers = probe.managers()
    return (sum(m.num_tokens_evicted for m in managers),
            sum(m.num_compactions for m in managers))


@pytest.mark.parametrize("policy", RECORDING)
def test_budget_above_length_is_token_identical_to_stock(engines, model_path, policy):
    """Budget >= sequence length: no eviction, and the plugin's path (own KV write,
    scoring) must not change a single token versus vLLM without the plugin
    (stock: a subprocess with VLLM_PLUGINS="", once per session)."""
    from vllm_kvevict.probe import attach

    llm = engines.get(**engine_settings(policy))
    probe = attach(llm)
    before = totals(probe)
    ours = [list(o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, greedy(STOCK_TOKENS, ignore_eos=True), use_tqdm=False)]
    assert totals(probe) == before  # nothing evicted: the comparison is about the path
    assert ours == stock_ids(model_path, DTYPE), policy


@pytest.mark.parametrize("policy", list(POLICIES))
def test_scoring_every_step_without_eviction_is_token_identical_to_stock(
        engines, model_path, policy, monkeypatch):
    """The test above proves the write and attention path only: its requests can
    never exceed the budget, so the planner marks them unscored. Here each
    request's budget is one token under its final length: it may compact, so
    every step is scored (h2o: each query's attention, through the compiled CPU
    kernel where it is built; snapkv/andpro: the query window records), yet no
    token it writes reaches the budget (its last sampled token is never
    written), so no compaction fires (at physical >= budget). Nothing is
    evicted, and the tokens must equal stock vLLM's. Decode steps take the
    log-only path where the compiled copier stores queries (every layer hands
    its queries over by reference: QueryBuffers.hold_ref). streaming has no
    scores: the same run proves its path with a budget below the length."""
    import torch
    from vllm import SamplingParams

    from vllm_kvevict import cpu_kernel
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_copier
    from vllm_kvevict.core.scoring.query_buffers import QueryBuffers
    from vllm_kvevict.probe import attach
    from vllm_kvevict.integration.worker import worker_state

    llm = engines.get(**engine_settings(policy))
    state = worker_state()
    seen = {"kernel": 0, "window": 0, "by_reference": 0}
    ring = state.query_window.queries  # where the window's queries land (QueryBuffers)
    real_store = ring._store
    real_hold_ref = QueryBuffers.hold_ref  # the layers' hand-over in log-only steps
    monkeypatch.setattr(QueryBuffers, "hold_ref", lambda self, *a: (
        seen.__setitem__("by_reference", seen["by_reference"] + 1), real_hold_ref(self, *a)))
    for name in ("column_sums", "add_column_sums"):
        monkeypatch.setattr(cpu_kernel, name, lambda *a, f=getattr(cpu_kernel, name): (
            seen.__setitem__("kernel", seen["kernel"] + 1) or f(*a)))
    monkeypatch.setattr(ring, "_store", lambda items, placement, rows: (
        seen.__setitem__("window", seen["window"] + len(items) * placement.tokens.numel()),
        real_store(items, placement, rows)))
    with torch.inference_mode():  # the buffers were made inside vLLM's inference mode
        for lc in state.layers.values():
            lc.scores.zero_()
    tok = llm.get_tokenizer()
    params = [SamplingParams(temperature=0, max_tokens=STOCK_TOKENS, ignore_eos=True, extra_args={
        "kv_budget": len(tok(p)["input_ids"]) + STOCK_TOKENS - 1}) for p in PROMPTS]
    probe = attach(llm)
    before = totals(probe)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert totals(probe) == before  # nothing evicted
    ring.commit()  # the last step's queries, still held by reference
    records = POLICIES[policy].records
    if records is Record.ATTENTION:
        assert sum(float(lc.scores.abs().sum()) for lc in state.layers.values()) > 0
        assert seen["kernel"] > 0 or cpu_kernel.isa() is None
    if records is Record.QUERIES:  # every token's query, in every layer, stored in the ring
        assert seen["window"] >= len(state.layers) * len(PROMPTS) * STOCK_TOKENS
    if records is not Record.NOTHING and cpu_copier() is not None:
        # decode steps only log: each layer handed its queries over by reference
        assert seen["by_reference"] >= len(state.layers) * (STOCK_TOKENS - 1)
    assert ours == stock_ids(model_path, DTYPE), policy


@pytest.mark.skipif(DTYPE == "bfloat16", reason="the CPU's native dtype is bfloat16: "
                    "test_budget_above_length_is_token_identical_to_stock ran in it")
def test_budget_above_length_is_token_identical_to_stock_in_bfloat16(fresh_engines, model_path):
    """The same in bfloat16 (what users serve), whatever the CPU's native dtype:
    the bf16 KV layouts and kernels, end to end, for the policy that scores
    every step."""
    llm = make_llm(model_path, dtype="bfloat16", additional_config={
        "kv_eviction": "h2o", "kv_budget": SERVER_BUDGET})
    try:
        ours = [list(o.outputs[0].token_ids) for o in
                llm.generate(PROMPTS, greedy(STOCK_TOKENS, ignore_eos=True), use_tqdm=False)]
    finally:
        close(llm)
    assert ours == stock_ids(model_path, "bfloat16")


@pytest.fixture
def h2o_engine(engines):
    from vllm_kvevict.probe import attach

    llm = engines.get(**H2O)
    return llm, attach(llm)


def _pool_is_whole(probe):
    return probe.used_blocks() == 0


def test_decode_blocks_stay_bounded_and_return_to_pool(h2o_engine):
    """Long generations at budget 64 (block 32): each request holds at most
    ceil(64/32) = 2 blocks (the budget is a cap) according to vLLM's
    req_to_blocks, blocks really
    go back to the BlockPool, and the pool is whole once the engine is idle."""
    llm, probe = h2o_engine
    evicted0, _ = totals(probe)
    outs = llm.generate(PROMPTS, greedy(300, 64, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 300 for o in outs)
    assert probe.max_blocks_per_request <= max_blocks_per_request(64, 32)
    evicted = totals(probe)[0] - evicted0
    assert evicted >= len(PROMPTS) * 200
    assert _pool_is_whole(probe)


def _long_prompt(llm, n=1500):
    text = open("/usr/share/common-licenses/GPL-3").read()
    return llm.get_tokenizer()(text)["input_ids"][:n]


def _fallbacks(probe) -> int:
    return sum(m.num_prefill_fallbacks for m in probe.managers())


def test_chunked_prefill_of_a_prompt_longer_than_the_budget(h2o_engine):
    """With --kv-prefill-cap 0 (here per request), a 1,500-token prompt prefilled
    in 256-token chunks is compacted between chunks and never holds more than
    budget + one chunk; each such compaction is counted."""
    llm, probe = h2o_engine
    before = _fallbacks(probe)
    params = greedy(20, 64)
    params.extra_args["kv_prefill_cap"] = 0
    out = llm.generate([{"prompt_token_ids": _long_prompt(llm)}], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 20
    assert probe.max_blocks_per_request <= -(-(64 + 256) // 32)
    assert _fallbacks(probe) - before == 1500 // 256  # before chunks 2..6
    assert _pool_is_whole(probe)


def test_prompt_is_compacted_once_after_its_last_chunk(h2o_engine):
    """Issue 18, the default: with room in the pool, the same prompt stays whole
    through its 6 chunks (so H2O scores it with every prompt query, the end of
    the prompt included) and is compacted once, at its first decode step, from
    1,500 tokens straight to a block below the budget (64, a cap); decode then
    compacts once per block, each time the budget is reached."""
    from vllm_kvevict.integration.worker import WorkerEviction

    llm, probe = h2o_engine
    before = _fallbacks(probe)
    plans, original = [], WorkerEviction._compact

    def compact(self, batch):
        plans.extend(batch)
        return original(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WorkerEviction, "_compact", compact)
        out = llm.generate([{"prompt_token_ids": _long_prompt(llm)}], greedy(40, 64),
                           use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40
    first = plans[0]
    assert (first.logical_len, first.old_len, first.new_len) == (1500, 1500, 32), first
    assert all(p.logical_len > 1500 and (p.old_len, p.new_len) == (64, 32)
               for p in plans[1:]), plans
    assert probe.max_blocks_per_request >= -(-1500 // 32)  # it really held the prompt
    assert _fallbacks(probe) == before
    assert _pool_is_whole(probe)


def test_aborted_requests_free_everything(h2o_engine):
    """Requests aborted mid-decode give every block back."""
    llm, probe = h2o_engine
    engine = llm.llm_engine
    params = greedy(400, 64, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(120):  # well past several compactions
        engine.step()
    assert probe.used_blocks() > 0
    engine.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    while engine.has_unfinished_requests():
        engine.step()
    assert _pool_is_whole(probe)


def test_requests_that_never_exceed_the_budget_are_not_scored(h2o_engine):
    """At budget 64, a 20-token prompt with max_tokens 30 can never compact: the
    workers skip its scoring (the score buffers stay zero); a long request is scored."""
    import torch

    from vllm_kvevict.integration.worker import worker_state

    llm, _ = h2o_engine
    state = worker_state()
    with torch.inference_mode():  # the buffers were made inside vLLM's inference mode
        for lc in state.layers.values():
            lc.scores.zero_()
    ids = llm.get_tokenizer()(PROMPTS[0])["input_ids"][:20]
    llm.generate([{"prompt_token_ids": ids}], greedy(30, 64, ignore_eos=True), use_tqdm=False)
    assert sum(float(lc.scores.abs().sum()) for lc in state.layers.values()) == 0
    llm.generate([{"prompt_token_ids": ids}], greedy(60, 64, ignore_eos=True), use_tqdm=False)
    assert sum(float(lc.scores.abs().sum()) for lc in state.layers.values()) > 0


def _h2o_kept_sets(llm, defer: bool):
    """Greedy tokens and every compaction's kept positions under H2O at budget 64,
    keyed by the request's place in the batch."""
    from vllm_kvevict.integration import worker as worker_mod

    state = worker_mod.worker_state()
    recorder = KeptRecorder(state)
    if not defer:
        state.place_queries = lambda *args, **kw: None  # score every step at once
    try:
        outs = [list(o.outputs[0].token_ids) for o in
                llm.generate(PROMPTS, greedy(160, 64, ignore_eos=True), use_tqdm=False)]
    finally:
        recorder.remove()  # back to the class's methods
        if not defer:
            del state.place_queries
    # vLLM ids: "<index>-<random suffix>"
    kept = [(int(plan.req_id.split("-")[0]), plan.logical_len, positions)
            for plan, positions in recorder.compactions]
    first = min(k[0] for k in kept)  # the engine numbers requests across calls
    return outs, sorted(((i - first, n, p) for i, n, p in kept), key=lambda k: (k[0], k[1]))


def test_deferred_decode_scoring_equals_scoring_every_step(h2o_engine, monkeypatch):
    """The CPU path scores decode queries up to 32 steps at a time (DecodeQueryLog).
    It must keep the same tokens, per layer and KV head, as scoring each step's
    queries at once, through every compaction of a batch, and generate the same text.
    With the fused pass off: once every request has evicted, a step would take it
    and log nothing (tests/test_fused_engine.py), and its attention is not vLLM's
    bit for bit, which the undeferred run keeps."""
    monkeypatch.setenv("VLLM_KVEVICT_CPU_FUSED", "off")
    llm, _ = h2o_engine
    outs_d, kept_d = _h2o_kept_sets(llm, defer=True)
    outs_e, kept_e = _h2o_kept_sets(llm, defer=False)
    assert len(kept_d) == len(kept_e) >= len(PROMPTS) * 3
    for (rd, ld, pd), (re_, le, pe) in zip(kept_d, kept_e):
        assert (rd, ld) == (re_, le)
        same = (pd.sort(dim=-1).values == pe.sort(dim=-1).values).all(dim=-1)
        assert same.float().mean() > 0.99, (rd, ld)  # float summation order aside
    assert outs_d == outs_e


def test_bad_settings_stop_engine_startup(model_path):
    """Nothing half-configured: the engine refuses to start, naming the flag."""
    from vllm_kvevict.core.config.settings import EvictionConfigError

    with pytest.raises(EvictionConfigError, match="--kv-eviction"):
        make_llm(model_path, additional_config={"kv_eviction": "lru"})
    with pytest.raises(EvictionConfigError, match="--kv-budget.*below one KV block"):
        make_llm(model_path, additional_config={"kv_eviction": "h2o", "kv_budget": 16})
    with pytest.raises(EvictionConfigError, match="--kv-window"):
        make_llm(model_path, additional_config={"kv_eviction": "andpro", "kv_window": "x"})


@pytest.mark.parametrize("policy", WINDOWED)
def test_window_policies_bound_blocks_and_free_everything(engines, policy):
    """A 700-token prompt in 256-token chunks, compacted between chunks
    (kv_prefill_cap 0: the path a short pool takes), and 200 decode tokens at
    budget 96: every compaction is scored from a full window, each request stays
    within the block bound (vLLM's req_to_blocks), and pool and query ring are
    empty once the requests finish. (The default, one compaction after the last
    chunk, is held to the dense reference in test_window_reference.py.)"""
    from vllm_kvevict.probe import attach
    from vllm_kvevict.integration.worker import worker_state

    text = open("/usr/share/common-licenses/GPL-3").read()
    llm = engines.get(**engine_settings(policy))
    probe, state = attach(llm), worker_state()
    windowless0, (evicted0, compactions0) = state.num_windowless, totals(probe)
    prompts = [{"prompt_token_ids": llm.get_tokenizer()(text[i * 3000:])["input_ids"][:700]}
               for i in range(3)]
    params = greedy(200, 96, ignore_eos=True)
    params.extra_args["kv_prefill_cap"] = 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    evicted, compactions = (n - n0 for n, n0 in zip(totals(probe), (evicted0, compactions0)))
    # Workers hear of finished requests with the next step: run one more (a
    # request that can never exceed the budget logs nothing itself).
    llm.generate(["Hi"], greedy(4), use_tqdm=False)
    windowless, ring = state.num_windowless - windowless0, dict(state.query_window.row_of)
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
    assert probe.max_blocks_per_request <= -(-(96 + 256) // 32)  # budget + one chunk
    assert evicted >= 3 * (900 - 96 - 32) and compactions >= 3 * 8
    assert windowless == 0 and not ring
    assert _pool_is_whole(probe)


def test_streaming_keeps_exactly_sinks_and_recent_and_prefix_caching_is_safe(engines):
    """StreamingLLM: after each compaction every (layer, head) holds exactly the
    first 4 logical positions and the newest ones. With prefix caching on, two
    requests sharing a long prompt produce the same tokens as with it off: shared
    prompt blocks are never written in place by compaction. That the second
    request did hit the cache (every whole block of the shared prefix, none
    with caching off) is read from vLLM's `num_cached_tokens` on its output.

    In float32: the kept sets are equal either way, but the prefix hit's
    private copies leave its kept tokens in another slot order, and in bf16
    attention summed in another order flipped a near-tied token (token 19 of
    the second request, one thread per worker; stock vLLM and streaming
    without compaction gave equal tokens). In float32 the same runs agree."""
    import torch

    from vllm_kvevict.integration import worker as worker_mod

    shared = open("/usr/share/common-licenses/GPL-3").read()[:1200]
    prompts = [shared + "\nQuestion: what is this?", shared + "\nQuestion: who wrote it?"]
    results = {}
    for caching in (False, True):
        llm = engines.get(enable_prefix_caching=caching, dtype="float32",
                          additional_config={"kv_eviction": "streaming", "kv_budget": 96})
        recorder = KeptRecorder(worker_mod.worker_state())
        try:
            outs, cached = [], []
            for p in prompts:  # one after the other: the second hits the prefix cache
                out = llm.generate([p], greedy(120, ignore_eos=True), use_tqdm=False)[0]
                outs.append(list(out.outputs[0].token_ids))
                cached.append(out.num_cached_tokens)
        finally:
            recorder.remove()
        seen = recorder.compactions
        results[caching] = outs
        # vLLM's own count of prompt tokens served from its prefix cache: with
        # caching, the second request reuses every whole block of the shared prefix.
        ids = [llm.get_tokenizer()(p)["input_ids"] for p in prompts]
        common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
        block = llm.llm_engine.vllm_config.cache_config.block_size
        assert cached[1] == (common // block * block if caching else 0), (caching, cached, common)
        assert seen
        for plan, kept in seen:
            want = list(range(4)) + list(range(plan.logical_len - (plan.new_len - 4),
                                               plan.logical_len))
            assert (kept == torch.tensor(want)).all(), plan
    assert results[True] == results[False]


def test_preemption_under_eviction_gives_every_block_back(fresh_engines, model_path):
    """A pool of 12 blocks for 6 requests that each need up to 3 under H2O
    (budget 96, a cap): vLLM preempts and later re-prefills some of them. Every request
    still finishes at full length, the per-request bound holds, queries logged
    for a preempted request are dropped with its blocks, and the pool is whole."""
    from vllm_kvevict.probe import attach
    from vllm_kvevict.integration.worker import worker_state

    token_bytes = 30 * 3 * 64 * 2 * (4 if DTYPE == "float32" else 2)  # SmolLM2: K+V, 30 layers
    llm = make_llm(model_path, max_num_batched_tokens=128, enable_prefix_caching=False,
                   kv_cache_memory_bytes=12 * 32 * token_bytes,  # 12 blocks
                   additional_config={"kv_eviction": "h2o", "kv_budget": 96})
    probe = attach(llm)
    assert probe.block_pool.num_gpu_blocks - 1 <= 12
    prompts = (PROMPTS + PROMPTS)[:6]
    outs = llm.generate(prompts, greedy(200, ignore_eos=True), use_tqdm=False)
    assert probe.used_blocks() == 0
    ids = {o.request_id for o in outs}  # the engine's ids add "-<random suffix>"
    known = lambda log: {r.split("-")[0] for r in log.row_of} & ids  # noqa: E731
    assert known(worker_state().decode_log)  # the last finisher, until the next step
    # Workers hear of finished requests with the next step: run one more.
    llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False)
    leftover = known(worker_state().decode_log)
    peak = probe.max_blocks_per_request
    # Issue 18's fallback: a 1,000-token prompt in a 384-token pool cannot stay
    # whole; it is compacted between chunks when the next one does not fit, and
    # finishes (nothing preempted, nothing refused).
    preempted = probe.preemptions
    [long] = llm.generate([{"prompt_token_ids": _long_prompt(llm, 1000)}], greedy(20),
                          use_tqdm=False)
    fallbacks = _fallbacks(probe)
    long_whole = probe.used_blocks() == 0
    close(llm)
    assert len(long.outputs[0].token_ids) == 20 and long_whole
    assert fallbacks > 0 and probe.preemptions == preempted
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
    assert probe.preemptions > 0, "the pool should force preemptions"
    bound = max(max_blocks_per_request(96, 32), -(-(96 + 128) // 32))  # decode / prefill
    assert peak <= bound
    assert not leftover, "finished requests left queries in the log"
