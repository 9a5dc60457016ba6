"""Time one in-process engine at a given torch thread count and dtype.

    .venv/bin/python scripts/measure/engine_threads.py THREADS DTYPE [POLICY]
    PYTHONPATH=scripts/measure KVEVICT_AS_AVX2=1 .venv/bin/python scripts/measure/engine_threads.py 2 float32 h2o

Prints engine start, 4 x 160 greedy decode tokens and 2 x 1,500-token prefill
times (SmolLM2, block 32, budget 64 when a policy is given): what
tests/conftest.py's thread and dtype choices rest on.
"""

import os
import sys
import time

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as in the tests
    import torch

    n, dtype = int(sys.argv[1]), sys.argv[2]
    policy = sys.argv[3] if len(sys.argv) > 3 else None
    torch.set_num_threads(n)
    from vllm import LLM, SamplingParams

    from vllm_kvevict.models import ensure_smollm2

    prompts = ["Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
               "Explain, step by step, how a CPU executes an instruction.",
               "Summarize what copyleft means.", "List ten ideas for a science fair project."]
    t0 = time.perf_counter()
    extra = {"kv_eviction": policy, "kv_budget": 64} if policy else {}
    llm = LLM(ensure_smollm2(), enforce_eager=True, seed=0, block_size=32, max_model_len=2048,
              kv_cache_memory_bytes=192 << 20, dtype=dtype, additional_config=extra)
    t1 = time.perf_counter()
    torch._C.set_num_threads(n)  # vLLM's CPU worker turns torch.set_num_threads into a no-op
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True),
                 use_tqdm=False)
    t2 = time.perf_counter()
    ids = llm.get_tokenizer()(open("/usr/share/common-licenses/GPL-3").read())["input_ids"][:1500]
    llm.generate([{"prompt_token_ids": ids}] * 2, SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    t3 = time.perf_counter()
    print(f"threads={n} dtype={dtype} policy={policy} start {t1 - t0:.1f}s "
          f"decode 4x160 {t2 - t1:.1f}s prefill 2x1500 {t3 - t2:.1f}s")
