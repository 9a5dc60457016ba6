"""Greedy token ids from stock vLLM with our plugin disabled (VLLM_PLUGINS="").

    python tests/stock_generate.py MODEL MAX_TOKENS BLOCK_SIZE DTYPE KV_BYTES [KV_CACHE_DTYPE] \
        < prompts.json > ids.json

Every request generates MAX_TOKENS tokens (ignore_eos).
"""

import atexit
import gc
import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_PLUGINS"] = ""  # not even our backend subclass is registered
    from vllm import LLM, SamplingParams

    # The engine's start then collects only what is new (vllm_kvevict/inprocess.py).
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # else Triton's nanobind types report leaks at exit
    model, max_tokens, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dtype, kv_bytes = sys.argv[4], int(sys.argv[5])
    kv_cache_dtype = sys.argv[6] if len(sys.argv) > 6 else "auto"
    prompts = json.load(sys.stdin)
    llm = LLM(model, enforce_eager=True, dtype=dtype, seed=0, block_size=block_size,
              max_model_len=2048, kv_cache_memory_bytes=kv_bytes, kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    assert "vllm_kvevict" not in sys.modules, "plugin loaded despite VLLM_PLUGINS=''"
    print("IDS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
