"""Offline batch with H2O eviction: settings go through additional_config.
Prints the answers, then the plugin's counters (what `/metrics` shows when
serving: tokens evicted, blocks returned to vLLM's pool, compactions).

    python examples/offline_h2o.py [MODEL]
"""

import sys

from prometheus_client import REGISTRY, generate_latest
from vllm import LLM, SamplingParams


def main() -> None:
    from vllm_kvevict.models import ensure_smollm2

    model = sys.argv[1] if len(sys.argv) > 1 else ensure_smollm2()
    llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=2048,
              kv_cache_memory_bytes=256 << 20,
              additional_config={"kv_eviction": "h2o", "kv_budget": 256, "kv_recent": 64})
    prompts = [[{"role": "user", "content": "Tell me a long story about a robot."}],
               [{"role": "user", "content": "Explain how tides work, in detail."}]]
    for out in llm.chat(prompts, SamplingParams(temperature=0, max_tokens=400)):
        print(out.outputs[0].text, "\n---")
    # The engine core writes the counters; the plugin's collector in this
    # process sums them into prometheus_client's registry, as in `vllm serve`.
    print("\n".join(line for line in generate_latest(REGISTRY).decode().splitlines()
                    if line.startswith("vllm_kvevict_")))


if __name__ == "__main__":
    main()
