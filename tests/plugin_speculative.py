"""Greedy token ids from vLLM with the plugin and n-gram speculative decoding,
for tests/test_speculative_decoding.py: one engine after another in a child of
its own (the test module's worker holds its in-process H2O engine; one child
for all the cases saves an interpreter and vLLM's imports per case, and a
later n-gram engine starts in the process thanks to patches/dispatcher_scan.py).

    python tests/plugin_speculative.py MODEL KV_BYTES < [run, ...]
    run: {"policy": ..., "max_tokens": ..., "prompts": [...], "budgets": [...],
          "speculative_config": {...},
          "schema": optional PML schema, registered before the prompts run}

Prints RUNS= and a list, one entry per run: its token ids and what the worker
and the scheduler saw (stats): tokens evicted, the most blocks a request held
in a decode step, blocks held once every request finished (a schema's pinned
blocks aside), drafts logged and rolled back, H2O's score mass, the window's
rows, each output's cached tokens.
"""

import json
import os
import sys


def run(model: str, kv_bytes: int, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from decode_blocks import DecodeBlocks
    from vllm_kvevict.inprocess import close
    from vllm_kvevict.integration.worker import worker_state
    from vllm_kvevict.probe import attach, full_attention_manager, scheduler_of

    llm = LLM(model, enforce_eager=True, dtype="float32", seed=0, block_size=32,
              max_model_len=2048, kv_cache_memory_bytes=kv_bytes,
              speculative_config=case["speculative_config"],
              additional_config={"kv_eviction": case["policy"], "kv_budget": 1024})
    try:
        params = [SamplingParams(temperature=0, max_tokens=case["max_tokens"], ignore_eos=True,
                                 extra_args={"kv_budget": b}) for b in case["budgets"]]
        pinned = 0
        if case.get("schema"):
            from vllm_kvevict.integration import prompt_modules as pm

            pm.register_schema(llm, case["schema"])
            pinned = sum(len(e["block_ids"]) for e in pm.pinned_modules(llm).values())
        probe = attach(llm, DecodeBlocks)
        outs = llm.generate(case["prompts"], params, use_tqdm=False)

        state = worker_state()  # this engine's: each engine start makes its own
        stats = {"evicted": full_attention_manager(scheduler_of(llm)).num_tokens_evicted,
                 "max_decode_blocks": probe.max_decode_blocks,
                 "used_after": probe.used_blocks() - pinned,
                 "drafts_logged": state.drafts_logged, "drafts_rejected": state.drafts_rejected,
                 "score_sum": sum(float(lc.scores.abs().sum()) for lc in state.layers.values()),
                 "window_rows": len(state.query_window.row_of),
                 "num_cached": [o.num_cached_tokens for o in outs]}
        return {"ids": [list(o.outputs[0].token_ids) for o in outs], "stats": stats}
    finally:
        close(llm)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's state in this process
    model, kv_bytes = sys.argv[1], int(sys.argv[2])
    cases = json.load(sys.stdin)
    print("RUNS=" + json.dumps([run(model, kv_bytes, c) for c in cases]))
