"""Shared fixtures: the real converted SmolLM2 model and in-process engines."""

import gc
import os

# In-process engine core: tests read vLLM's own BlockPool and the worker state.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# Triton kernels run on CPU only through the interpreter, which must be on
# before anything imports triton.language (vLLM does, at import): a kernel
# decorated without it cannot call tl.* helpers under it later. vLLM's CPU
# path runs no Triton kernel, so the engines are unaffected.
if not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

PROMPTS = [
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a CPU executes an instruction.",
    "The GNU General Public License is a free, copyleft license for software and other "
    "kinds of works. Summarize what copyleft means.",
    "List ten ideas for a science fair project.",
]


@pytest.fixture(scope="session")
def model_path():
    from vllm_kvevict.models import ensure_smollm2

    return ensure_smollm2()


def make_llm(model_path, **kwargs):
    from vllm import LLM

    kwargs.setdefault("block_size", 32)
    kwargs.setdefault("max_model_len", 2048)
    kwargs.setdefault("kv_cache_memory_bytes", 96 << 20)
    kwargs.setdefault("dtype", "bfloat16")
    return LLM(model_path, enforce_eager=True, seed=0, **kwargs)


def close(llm):
    """Shut the engine down now. Leaving it to the garbage collector would tear
    down vLLM's process-global parallel groups under the next engine."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
