"""Prompt modules keep retrieval quality: a small benchmarks/prompt_modules_quality.py.

The first 6 instances of that benchmark's niah set (the fidelity harness's
generator, seed 0: 1K-token Austen haystacks, passcode at depths 0.1..0.9),
each haystack cut at a sentence end into 2 documents of ~500 tokens that
become prompt modules (encoded alone, at their schema positions). Scored with
the harness's scorer against the plain harness prompt on the same float32
engine, greedy, 32 tokens.

Why 2 documents: that is where the benchmark measures module prompts within
noise of the plain prompt. With 4 documents (~250 tokens) the module prompt
loses 4 of 20 instances and with 8 (~125 tokens) 12 of 20, against 3 and 2
lost by reordering the plain prompt's documents (benchmarks/
prompt_modules_quality.md); a dense transformers run of the same masked
computation gives the same outputs, so that drop is the Prompt Cache method on
this 135M model, not a plugin bug. This test guards the regime where the
method holds.
"""

import time

import pytest
from conftest import close, make_llm

from vllm_kvevict.eval import prompt_modules_quality as Q

GEN = Q.CONFIGS["default"]["niah"]["gen"]  # the benchmark's instances; the first N_INSTANCES
N_INSTANCES = 6  # ~2 minutes on 2 busy cores; each costs two 1K-token prefills
N_DOCS = 2
POOL_MIB = 512  # all 6 schemas pinned at once, next to their requests (fp32)

# Tolerance on |mean module score - mean plain score| over the 6 instances.
# Measured noise (results/prompt_modules_quality/, default run): putting
# the documents of the plain prompt in another order, which the answer does
# not depend on, changed the niah score of 9 of 60 (instance, split) pairs
# (3 better, 6 worse): p = 0.15 per instance. If each instance independently
# gets better or worse with probability p/2 each, the net count U - D over 6
# instances has P(|U - D| >= 2) = 0.10 and P(|U - D| >= 3) = 0.011: 2/6 is the
# smallest tolerance that noise of that size exceeds less than 5% of the time.
# Garbage module KV scores ~0 against a plain score of 5/6 here, so it fails
# (checked once by overwriting the pinned blocks with noise).
TOLERANCE = 2 / 6
MIN_PLAIN = 0.7  # below this the test could not see a drop


@pytest.fixture(scope="module")
def cases(model_path, engines):
    from transformers import AutoTokenizer

    from vllm_kvevict.eval.texts import texts_dir

    missing = [h for h in GEN["haystacks"] if not (texts_dir() / f"{h}.txt").is_file()]
    if missing:
        pytest.fail(f"texts {missing} missing: run `python -m vllm_kvevict.eval.texts`")
    tok = AutoTokenizer.from_pretrained(model_path)
    insts = Q.build("niah", tok, GEN, (0,))[:N_INSTANCES]
    cases = Q.prepare("niah", insts, tok, (N_DOCS,))
    engines.close()  # one in-process engine at a time
    llm = make_llm(model_path, dtype="float32", max_model_len=2048,
                   kv_cache_memory_bytes=POOL_MIB << 20)
    try:
        t0 = time.perf_counter()
        Q.run_plain(llm, cases)
        Q.run_modules(llm, cases, N_DOCS, Q.kv_pool_tokens(POOL_MIB, "float32"))
        print(f"plain + modules: {time.perf_counter() - t0:.1f} s")
    finally:
        close(llm)
    Q.score(cases)
    return cases


def test_module_prompt_has_the_plain_prompts_tokens_and_positions(cases):
    """So the only difference left is how the modules' KV was computed."""
    assert all(c["splits"][N_DOCS]["exact"] for c in cases)


def test_module_tokens_really_come_from_the_modules(cases):
    """vLLM reports the shared blocks as cached: ~93% of each prompt here (the
    rest: chat prefix, each module's last partial block, the question)."""
    for c in cases:
        out = c["splits"][N_DOCS]["modules_out"]
        assert out["cached"] >= 0.85 * out["prompt_len"], c["inst"]["id"]


def test_module_score_is_within_noise_of_the_plain_score(cases):
    plain = sum(c["plain_score"] for c in cases) / len(cases)
    modules = sum(c["splits"][N_DOCS]["modules_score"] for c in cases) / len(cases)
    detail = "\n".join(f'{c["inst"]["id"]}: plain {c["plain_score"]} '
                       f'{c["plain_out"]["text"][:50]!r} | modules '
                       f'{c["splits"][N_DOCS]["modules_score"]} '
                       f'{c["splits"][N_DOCS]["modules_out"]["text"][:50]!r}' for c in cases)
    assert plain >= MIN_PLAIN, detail
    assert abs(modules - plain) <= TOLERANCE + 1e-9, \
        f"plain {plain:.2f}, modules {modules:.2f}\n{detail}"
