"""Greedy token ids from vLLM with the plugin and n-gram speculative decoding,
in a child of its own, for tests/test_speculative_decoding.py: vLLM 0.32
cannot build a second n-gram engine in one process (its Triton kernel
dispatcher scans every module at engine start and trips on llvmlite's
library wrapper, which the n-gram proposer's numba import brought in).

    python tests/plugin_speculative.py MODEL MAX_TOKENS POLICY KV_BYTES \
        < {"prompts": [...], "budgets": [...], "speculative_config": {...},
           "schema": optional PML schema, registered before the prompts run}

Prints IDS= and, after it, what the worker and the scheduler saw (STATS=):
tokens evicted, the most blocks a request held in a decode step, blocks held
once every request finished (a schema's pinned blocks aside), drafts logged and
rolled back, H2O's score mass, the window's rows, each output's cached tokens.
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's state in this process
    model, max_tokens, policy, kv_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    payload = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(model, enforce_eager=True, dtype="float32", seed=0, block_size=32,
              max_model_len=2048, kv_cache_memory_bytes=kv_bytes,
              speculative_config=payload["speculative_config"],
              additional_config={"kv_eviction": policy, "kv_budget": 1024})
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                             extra_args={"kv_budget": b}) for b in payload["budgets"]]
    from vllm_kvevict.integration.worker import worker_state
    from decode_blocks import DecodeBlocks
    from vllm_kvevict.probe import attach, full_attention_manager, scheduler_of

    if payload.get("schema"):
        from vllm_kvevict.integration import prompt_modules as pm

        pm.register_schema(llm, payload["schema"])
        pinned = sum(len(e["block_ids"]) for e in pm.pinned_modules(llm).values())
    else:
        pinned = 0
    probe = attach(llm, DecodeBlocks)
    outs = llm.generate(payload["prompts"], params, use_tqdm=False)

    state = worker_state()
    stats = {"evicted": full_attention_manager(scheduler_of(llm)).num_tokens_evicted,
             "max_decode_blocks": probe.max_decode_blocks, "used_after": probe.used_blocks() - pinned,
             "drafts_logged": state.drafts_logged, "drafts_rejected": state.drafts_rejected,
             "score_sum": sum(float(lc.scores.abs().sum()) for lc in state.layers.values()),
             "window_rows": len(state.query_window.row_of),
             "num_cached": [o.num_cached_tokens for o in outs]}
    print("IDS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    print("STATS=" + json.dumps(stats))
