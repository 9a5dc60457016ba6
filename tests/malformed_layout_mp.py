"""A malformed prompt-module layout sent straight to a multiprocess engine core.

    python tests/malformed_layout_mp.py MODEL DTYPE KV_BYTES > result

Past the frontend's checks (an EngineCoreRequest handed to the core client),
the engine core process must fail that request alone: vLLM's input thread
answers a request whose preprocessing raises with finish_reason "error".
Prints RESULT={"bad": [finish reasons], "next": tokens of a later request}.
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
    from vllm import LLM, SamplingParams

    model, dtype, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model, enforce_eager=True, dtype=dtype, seed=0, block_size=32, max_model_len=2048,
              kv_cache_memory_bytes=kv_bytes)
    engine, ip = llm.llm_engine, llm.llm_engine.input_processor
    build = type(ip).process_inputs.__kvevict_original__  # vLLM's own: checks no layout
    req = build(ip, "bad", {"type": "token", "prompt_token_ids": [101, 102, 103]},
                SamplingParams(max_tokens=4), supported_tasks=("generate",))
    req.sampling_params.extra_args = {"kvevict_layout": "not a dict"}
    req.external_req_id = req.request_id
    engine.output_processor.add_request(req, None, None, 0)
    engine.engine_core.add_request(req)
    reasons = []
    while engine.has_unfinished_requests():  # raises EngineDeadError if the core died
        reasons += [o.outputs[0].finish_reason for o in engine.step() if o.finished]
    out = llm.generate(["The engine still serves:"], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)[0]
    print("RESULT=" + json.dumps({"bad": reasons, "next": len(out.outputs[0].token_ids)}))
