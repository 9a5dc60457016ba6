"""The child side of the suite's stock-vLLM references (tests/stock_*.py, run
by conftest.run_child): an engine with our plugin not loaded at all, in the
suite's settings, and the line that hands the result back.

Import it only in those child processes: `stock_llm` sets VLLM_PLUGINS="" for
the process before vLLM is imported.
"""

import atexit
import gc
import json
import os
import sys


def stock_llm(model: str, dtype: str, kv_bytes: int, block_size: int = 32, **kwargs):
    """conftest.make_llm's engine, less the plugin: VLLM_PLUGINS="", so not even
    our backend subclass is registered."""
    os.environ["VLLM_PLUGINS"] = ""
    from vllm import LLM

    # The engine's start then collects only what is new (vllm_kvevict/inprocess.py).
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # else Triton's nanobind types report leaks at exit
    return LLM(model, enforce_eager=True, dtype=dtype, seed=0, block_size=block_size,
               max_model_len=2048, kv_cache_memory_bytes=kv_bytes, **kwargs)


def report(marker: str, result) -> None:
    """Print `result` as JSON after `marker` (conftest.run_child reads it back),
    once the plugin is known to have stayed out."""
    assert "vllm_kvevict" not in sys.modules, "plugin loaded despite VLLM_PLUGINS=''"
    print(marker + json.dumps(result))
