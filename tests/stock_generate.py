"""Greedy token ids from stock vLLM with our plugin disabled (VLLM_PLUGINS="").

    python tests/stock_generate.py MODEL MAX_TOKENS BLOCK_SIZE < prompts.json > ids.json
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_PLUGINS"] = ""  # not even our backend subclass is registered
    from vllm import LLM, SamplingParams

    model, max_tokens, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.load(sys.stdin)
    llm = LLM(model, enforce_eager=True, dtype="bfloat16", seed=0, block_size=block_size,
              max_model_len=2048, kv_cache_memory_bytes=96 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert "vllm_kvevict" not in sys.modules, "plugin loaded despite VLLM_PLUGINS=''"
    print("IDS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
