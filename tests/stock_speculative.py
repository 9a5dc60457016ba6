"""Greedy token ids from stock vLLM (VLLM_PLUGINS="") with n-gram speculative
decoding, for tests/test_speculative_decoding.py.

    python tests/stock_speculative.py MODEL MAX_TOKENS DTYPE KV_BYTES \
        < {"prompts": [...], "speculative_config": {...}} > ids

Every request generates MAX_TOKENS tokens (ignore_eos), block size 32.
"""

import json
import sys

from stock_engine import report, stock_llm

if __name__ == "__main__":
    model, max_tokens, dtype, kv_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    payload = json.load(sys.stdin)
    llm = stock_llm(model, dtype, kv_bytes, speculative_config=payload["speculative_config"])
    from vllm import SamplingParams

    outs = llm.generate(payload["prompts"], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           ignore_eos=True))
    report("IDS=", [list(o.outputs[0].token_ids) for o in outs])
