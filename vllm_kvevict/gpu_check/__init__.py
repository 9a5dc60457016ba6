"""The CUDA path on a real GPU, in one command that needs only torch and Triton.

    PYTHONPATH=. python3 -m vllm_kvevict.gpu_check --out DIR      # on a GPU machine
    python -m vllm_kvevict.gpu_check --dry-run --out DIR          # the same checks on CPU

The GPU machine this project is sometimes lent has torch and Triton but no vLLM
and nothing installed of ours, so nothing here imports vLLM (a test proves it)
and the kernels load from a plain checkout (`load_kernels`). Sections, each a
module:

  correctness    every Triton kernel against its plain-torch reference, over
                 dtypes, head sizes, block sizes and GQA groups, and at
                 Llama-2-13B's decode shape; outputs poisoned before each run
  timing         each kernel with CUDA events (`triton.testing.do_bench`,
                 median) against a device copy of the same bytes, and the fused
                 decode (attention + H2O scores) against attention alone and
                 torch's SDPA over the same keys laid out densely
  core_on_device the vLLM-free core (planner, policies, score accumulation,
                 compaction) driving a simulated request on the device, checked
                 step by step against the same run on the CPU
  syncs          host-device syncs of each kernel's launch path, counted with
                 the counter the CPU tests use (`sync_counter`) and, on a GPU,
                 with torch's own sync debug mode

`--dry-run` forces the CPU: Triton's interpreter, tiny shapes, no bf16 (the
interpreter has none), no timing against a device copy. It writes the same two
files (`gpu_check.json`, `gpu_check.md`), and runs in the default test tier so
the command cannot rot.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_kernels():
    """`vllm_kvevict.triton_kernels`, installed or from a bare checkout: pyproject
    maps the top-level `triton_kernels/` folder to that name only when the
    package is installed, and the GPU machine installs nothing of ours."""
    try:
        return importlib.import_module("vllm_kvevict.triton_kernels")
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "vllm_kvevict.triton_kernels", ROOT / "triton_kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "triton_kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kernel(name: str):
    """One launcher module (`paged_attention`, `window`, `compaction`,
    `partial_attention`, `reference`)."""
    load_kernels()
    return importlib.import_module(f"vllm_kvevict.triton_kernels.{name}")
