"""Stock vLLM (our plugin disabled, VLLM_PLUGINS="") on tests/test_lora.py's
batch: greedy tokens of prompts served with and without a LoRA adapter in one
generate call.

    python tests/stock_lora.py MODEL DTYPE KV_BYTES ADAPTER MAX_TOKENS < prompts.json

Prompt i takes the adapter when i is even. Prints IDS=[[ids] per prompt].
"""

import atexit
import gc
import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_PLUGINS"] = ""  # not even our backend subclass is registered
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # else Triton's nanobind types report leaks at exit
    model, dtype, kv_bytes, adapter = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    prompts = json.load(sys.stdin)
    # The settings of test_lora.py's engine, less the plugin's.
    llm = LLM(model, enforce_eager=True, dtype=dtype, seed=0, block_size=32, max_model_len=2048,
              kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=256, enable_lora=True,
              max_lora_rank=8, max_loras=2)
    lora = LoRARequest("random", 1, adapter)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=int(sys.argv[5]),
                                                ignore_eos=True),
                        lora_request=[lora if i % 2 == 0 else None for i in range(len(prompts))],
                        use_tqdm=False)
    assert "vllm_kvevict" not in sys.modules, "plugin loaded despite VLLM_PLUGINS=''"
    print("IDS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
