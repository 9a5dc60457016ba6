"""Stock vLLM (our plugin disabled, VLLM_PLUGINS="") on tests/test_lora.py's
batch: greedy tokens of prompts served with and without a LoRA adapter in one
generate call.

    python tests/stock_lora.py MODEL DTYPE KV_BYTES ADAPTER MAX_TOKENS < prompts.json

Prompt i takes the adapter when i is even. Prints IDS=[[ids] per prompt].
"""

import json
import sys

from stock_engine import report, stock_llm

if __name__ == "__main__":
    model, dtype, kv_bytes, adapter = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    prompts = json.load(sys.stdin)
    # The settings of test_lora.py's engine, less the plugin's.
    llm = stock_llm(model, dtype, kv_bytes, max_num_batched_tokens=256, enable_lora=True,
                    max_lora_rank=8, max_loras=2)
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("random", 1, adapter)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=int(sys.argv[5]),
                                                ignore_eos=True),
                        lora_request=[lora if i % 2 == 0 else None for i in range(len(prompts))],
                        use_tqdm=False)
    report("IDS=", [list(o.outputs[0].token_ids) for o in outs])
