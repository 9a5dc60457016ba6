"""Greedy token ids from stock vLLM with our plugin disabled (VLLM_PLUGINS="").

    python tests/stock_generate.py MODEL MAX_TOKENS BLOCK_SIZE DTYPE KV_BYTES [KV_CACHE_DTYPE] \
        < prompts.json > ids.json

Every request generates MAX_TOKENS tokens (ignore_eos).
"""

import json
import sys

from stock_engine import report, stock_llm

if __name__ == "__main__":
    model, max_tokens, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dtype, kv_bytes = sys.argv[4], int(sys.argv[5])
    kv_cache_dtype = sys.argv[6] if len(sys.argv) > 6 else "auto"
    prompts = json.load(sys.stdin)
    llm = stock_llm(model, dtype, kv_bytes, block_size, kv_cache_dtype=kv_cache_dtype)
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    report("IDS=", [list(o.outputs[0].token_ids) for o in outs])
