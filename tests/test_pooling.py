"""Pooling requests (`LLM(runner="pooling")`, `llm.embed`) under eviction.

A pooling request ends with its prompt: nothing of it is ever decoded, so
eviction saves it nothing. The plugin serves it as stock vLLM does (vLLM's
attention, its prompt whole; patches/scheduler_schedule.py never marks it
"evicts after its prompt", which would send its prompt through the CPU
attention pass and round its embedding differently). Prompts here are over
the budget, the requests the plugin would otherwise compact.
"""

import pytest
from conftest import DTYPE, PROMPTS, kv_bytes, make_llm, run_child

from vllm_kvevict.probe import attach

BUDGET = 64
# Over the budget: every prompt, rotated, in one text (~100 tokens); then two within it.
LONG = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(4)]
BATCH = LONG + PROMPTS[:2]


@pytest.fixture(scope="module")
def stock(model_path):
    return run_child("stock_pooling.py", [model_path, DTYPE, kv_bytes(DTYPE)], BATCH, "EMB=")


@pytest.fixture(scope="module")
def llm(engines, model_path):
    from vllm_kvevict.inprocess import close

    engines.close()  # the shared engine first: one engine in memory at a time
    llm = make_llm(model_path, runner="pooling", max_num_batched_tokens=256,
                   additional_config={"kv_eviction": "h2o", "kv_budget": BUDGET})
    yield llm
    close(llm)


def test_embeddings_over_the_budget_are_stocks_bit_for_bit(llm, stock):
    tokenizer = llm.get_tokenizer()
    assert all(len(tokenizer(p).input_ids) > BUDGET for p in LONG)
    (manager,) = attach(llm).managers()
    probe = attach(llm)
    outs = llm.embed(BATCH, use_tqdm=False)
    embeddings = [list(o.outputs.embedding) for o in outs]
    assert embeddings == stock
    assert manager.num_compactions == 0
    assert probe.used_blocks() == 0  # every block back in vLLM's pool
