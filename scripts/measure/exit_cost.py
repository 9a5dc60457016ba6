"""How long a process holding the API server's modules takes to exit, with
vLLM's frozen heap, with and without an unfreeze at exit.

    for m in stock plugin "plugin nounfreeze"; do
      s=$(date +%s.%N); .venv/bin/python scripts/measure/exit_cost.py $m > /tmp/o.txt 2>&1
      e=$(date +%s.%N); echo "$m: $(python3 -c "print(round($e - $(grep ^exiting /tmp/o.txt | cut -d' ' -f2), 2))") s"
    done

`plugin` registers an unfreeze at exit, as the plugin once did in every
process (2.2-2.8 s against stock's 0.25 s, 2026-11-29, Zen 4); `plugin
nounfreeze` leaves the heap frozen, as every served process now does.
"""
import atexit
import gc
import sys
import time

import vllm.entrypoints.openai.api_server  # noqa: F401  the API server's imports
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

if sys.argv[1] == "plugin":
    from vllm_kvevict import register

    register()
    if sys.argv[2:] != ["nounfreeze"]:
        atexit.register(gc.unfreeze)
gc.freeze()  # as vLLM's freeze_gc_heap, after startup
print("frozen objects", gc.get_freeze_count(), flush=True)
print("exiting", time.time(), flush=True)
