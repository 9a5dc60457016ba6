"""InfiniGen offload in the real engine: SmolLM2-135M through vLLM, the host
tier read from the worker, blocks read from vLLM's BlockPool, the skewing from
the file `python -m vllm_kvevict.calibrate` wrote (conftest.calibrated).
float32: the host path's torch attention and the stock kernel round alike
there. Stock is vLLM without the plugin (conftest.stock_ids, shared with test_engine.py)."""

import pytest
from conftest import PROMPTS, STOCK_TOKENS, stock_ids

from vllm_kvevict.core.eviction.planner import max_blocks_per_request

BUDGET = 96  # resident tokens, a cap: 64-96 held; block 32
# The skewing file the calibration command wrote this session: the engines load it.
pytestmark = pytest.mark.usefixtures("calibrated")


def greedy(max_tokens, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def _run(engines, extra, prompts, params):
    from vllm_kvevict.probe import attach
    from vllm_kvevict.integration.worker import worker_state

    llm = engines.get(dtype="float32", additional_config=extra)
    probe = attach(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    state = worker_state()
    host = None if state is None else state.host
    kvt = llm.llm_engine.vllm_config.kv_transfer_config
    stats = None if host is None else dict(host.stats.as_dict(), pool=host.pool.stats,
                                           connector=kvt.kv_connector)
    # vLLM tells workers about finished requests on the next step: run one.
    llm.generate(["hi"], greedy(2), use_tqdm=False)
    left = None if host is None else (len(host.pool), len(host.requests))
    return [list(o.outputs[0].token_ids) for o in outs], stats, probe, left


@pytest.fixture(scope="module")
def stock(model_path):
    return stock_ids(model_path, "float32")


@pytest.mark.parametrize("resident", ["infinigen", "h2o"])
def test_fetching_everything_back_is_token_identical_to_stock(engines, stock, resident):
    """alpha = inf and no cap: every offloaded entry comes back at every layer
    and step, so 160 greedy tokens equal stock vLLM's (float32: the host path's
    torch attention and the stock kernel round alike there). Meanwhile vLLM's
    req_to_blocks holds at most the budget's blocks, most KV lives on the host
    tier, and both tiers are empty once the requests are done."""
    extra = {"kv_eviction": resident, "kv_budget": BUDGET, "kv_alpha": "inf",
             "kv_attend_cap": 1.0, "kv_swap_space": "256MiB"}
    ids, stats, probe, left = _run(engines, extra, PROMPTS, greedy(STOCK_TOKENS, ignore_eos=True))
    assert ids == stock
    assert probe.max_blocks_per_request <= max_blocks_per_request(BUDGET, 32)
    assert stats["entries_offloaded"] > 0 and stats["entries_missed"] == 0
    assert stats["pool"].evictions == 0 and stats["pool"].prefetch_hits > 0
    # The prefetch went through our KV connector's per-layer hooks: speculating
    # with alpha = inf also selects every host entry, so every entry layers
    # 1-29 needed was already there when the layer ran. (Layer 0 attends its
    # full cache on demand: no layer before it to speculate from.)
    assert stats["connector"] == "KVEvictHostTier"
    assert stats["speculation_hits"] == stats["prefetch_needed"] > 0
    assert left == (0, 0) and probe.used_blocks() == 0


def test_default_threshold_fetches_a_fraction_and_stays_close(engines, stock):
    """InfiniGen's defaults (alpha 4, cap 20 %): far fewer entries come back than
    were offloaded, and the text stays close to the full cache's."""
    extra = {"kv_eviction": "infinigen", "kv_budget": BUDGET}
    ids, stats, probe, left = _run(engines, extra, PROMPTS, greedy(STOCK_TOKENS, ignore_eos=True))
    fetched_per_step = stats["entries_fetched"] / stats["fetch_steps"]
    offloaded_per_layer = stats["entries_offloaded"] / 30  # per (layer), all heads
    assert 0 < fetched_per_step < offloaded_per_layer / len(PROMPTS)
    same = sum(a == b for x, y in zip(ids, stock) for a, b in zip(x, y))
    assert same >= 0.5 * sum(map(len, stock))
    # Layer i-1's input predicted part of what layer i needed, not all of it.
    assert 0 < stats["speculation_hits"] < stats["prefetch_needed"]
    assert left == (0, 0) and probe.used_blocks() == 0


def test_full_host_pool_drops_by_victim_policy_and_abort_frees_both_tiers(engines):
    """A 16 MiB pool cannot hold 4 requests' offloaded KV: the counter policy
    drops blocks (their entries leave with their partial keys: entries_dropped,
    and every later fetch of those rows counts them in entries_missed). Aborting the requests
    mid-decode empties the host tier and vLLM's BlockPool."""
    from vllm_kvevict.probe import attach
    from vllm_kvevict.integration.worker import worker_state

    llm = engines.get(dtype="float32", additional_config={
        "kv_eviction": "infinigen", "kv_budget": BUDGET, "kv_swap_space": "16MiB"})
    probe = attach(llm)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, greedy(400, ignore_eos=True))
    for _ in range(300):
        engine.step()
    host = worker_state().host
    assert host.pool.stats.evictions > 0 and len(host.pool) == host.pool.capacity
    assert host.stats.entries_dropped > 0 and host.stats.entries_missed > 0
    assert probe.used_blocks() > 0
    engine.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    llm.generate(["hi"], greedy(2), use_tqdm=False)  # the step that tells the worker
    assert len(host.pool) == 0 and not host.requests
    assert probe.used_blocks() == 0

