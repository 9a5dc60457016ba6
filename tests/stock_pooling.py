"""Stock vLLM (our plugin disabled, VLLM_PLUGINS="") on tests/test_pooling.py's
prompts: their embeddings from the pooling runner.

    python tests/stock_pooling.py MODEL DTYPE KV_BYTES < prompts.json

Prints EMB=[[floats] per prompt].
"""

import json
import sys

from stock_engine import report, stock_llm

if __name__ == "__main__":
    model, dtype, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.load(sys.stdin)
    # The settings of test_pooling.py's engine, less the plugin's.
    llm = stock_llm(model, dtype, kv_bytes, runner="pooling", max_num_batched_tokens=256)
    outs = llm.embed(prompts, use_tqdm=False)
    report("EMB=", [list(o.outputs.embedding) for o in outs])
