"""Seconds to start and to close an in-process SmolLM2 engine, five times in
one process, with the heap left as vLLM leaves it or frozen after each close
(vllm_kvevict.inprocess.close), and the seconds of every full garbage
collection over 0.05 s (where they are called from).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure/engine_cycle.py [unfrozen|frozen]
"""

import gc
import os
import sys
import time
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
_collect = gc.collect


def _timed_collect(*args, **kwargs):
    frozen, start = gc.get_freeze_count(), time.perf_counter()
    out = _collect(*args, **kwargs)
    took = time.perf_counter() - start
    if took > 0.05:
        caller = traceback.extract_stack(limit=2)[0]
        print(f"  gc.collect{args}: {took:.2f} s, {frozen} objects frozen, from "
              f"{caller.filename.split('site-packages/')[-1]}:{caller.lineno}")
    return out


def main(mode: str) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from vllm_kvevict.inprocess import close
    from vllm_kvevict.models import ensure_smollm2

    torch.set_num_threads(1)
    model = ensure_smollm2()
    gc.collect = _timed_collect
    print(f"{mode}: {len(gc.get_objects())} objects tracked after imports")
    for _ in range(5):
        t0 = time.perf_counter()
        llm = LLM(model, enforce_eager=True, seed=0, block_size=32, max_model_len=2048,
                  kv_cache_memory_bytes=96 << 20, max_num_batched_tokens=256,
                  additional_config={"kv_eviction": "h2o", "kv_budget": 256})
        t1 = time.perf_counter()
        llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
        t2 = time.perf_counter()
        if mode == "frozen":
            close(llm)
        else:
            llm.llm_engine.engine_core.shutdown()
            gc.collect()
        del llm
        print(f"start {t1 - t0:.2f} s, generate {t2 - t1:.2f} s, close {time.perf_counter() - t2:.2f} s",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "frozen")
