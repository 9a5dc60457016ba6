"""Closing an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) in a
process that starts another one after it: the demo, the harness, the
benchmarks and the tests."""

import atexit
import gc

# Frozen objects outlive the interpreter's last collections, and extension
# types (Triton's nanobind ones) then report themselves leaked: unfreeze at
# exit (a no-op where nothing was frozen).
atexit.register(gc.unfreeze)


def freeze() -> None:
    """Collect, then freeze every object the process holds (see close)."""
    gc.collect()
    gc.freeze()


def close(llm) -> None:
    """Shut `llm`'s engine down now, and leave the heap frozen for the next one.

    Now: left to the garbage collector, the shutdown would tear vLLM's
    process-global parallel groups down under the next engine.

    Frozen: vLLM's shutdown unfreezes every object of the process
    (Worker.shutdown, EngineCore.shutdown), and the next engine's start runs
    three full collections before it freezes them again (two in load_model,
    one in freeze_gc_heap), each over the hundreds of thousands of objects a
    process holds after importing vLLM: frozen here, they are skipped, which
    takes about half off an in-process engine's start (docs/testing.md, with
    `scripts/measure/engine_cycle.py`). Frozen objects that die later are
    collected at the next engine's shutdown, which unfreezes them again.
    """
    llm.llm_engine.engine_core.shutdown()
    freeze()
