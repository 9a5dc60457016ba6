"""Measuring aids for the test suite, in every process of a run (a sitecustomize).

Count vLLM engine starts:

    PYTHONPATH=scripts/measure KVEVICT_ENGINE_LOG=/tmp/engines.log .venv/bin/python -m pytest
    .venv/bin/python scripts/measure/engine_summary.py /tmp/engines.log

Run as an AVX2-only CPU would (CI machines of this kind differ: some have no
AVX-512, and bf16 is several times slower there), on a machine that has AVX-512:

    PYTHONPATH=scripts/measure KVEVICT_AS_AVX2=1 .venv/bin/python -m pytest

(torch's kernels dispatch at AVX2, oneDNN stops at AVX2, and vLLM loads its
AVX2 build and picks the ISA it picks on such a CPU.) Known limit, measured:
tensor parallel 2 gives wrong tokens under this emulation, stock vLLM included
(TP 1 and TP 2 differ, workers fail with "index out of range"), so TP results
under it say nothing about a real AVX2 machine.

Python imports `sitecustomize` at startup from PYTHONPATH, in the test process
and in every child it starts (servers, engine cores, TP workers). Both aids act
when a module is first imported (nothing is imported early), and nothing
happens without their environment variables.
"""

import importlib.abc
import importlib.util
import os
import sys


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run `patch(module)` right after module `name` is first executed."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("KVEVICT_AS_AVX2") == "1":
    # Read by torch and oneDNN when they load.
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

    def _no_avx512(cpu):  # what vLLM asks before loading _C / _C_AVX2 and picking amx
        cpu._is_avx512_supported = lambda: False
        cpu._is_avx512_bf16_supported = lambda: False
        cpu._is_amx_tile_supported = lambda: False

    sys.meta_path.insert(0, _AfterImport("torch.cpu", _no_avx512))

_LOG = os.environ.get("KVEVICT_ENGINE_LOG")
if _LOG:
    import json
    import time

    def _count_inits(module):
        init = module.EngineCore.__init__

        def counted_init(self, *args, **kwargs):
            with open(_LOG, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "t": time.time(),
                                    "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                    "argv": sys.argv[:4]}) + "\n")
            return init(self, *args, **kwargs)

        module.EngineCore.__init__ = counted_init

    sys.meta_path.insert(0, _AfterImport("vllm.v1.engine.core", _count_inits))

# CPU seconds per process, written when it exits (a SIGKILLed one writes
# nothing), with what it was and which test started it:
#
#     PYTHONPATH=scripts/measure KVEVICT_CPU_LOG=/tmp/cpu.log .venv/bin/python -m pytest
#     .venv/bin/python scripts/measure/cpu_summary.py /tmp/cpu.log
_CPU_LOG = os.environ.get("KVEVICT_CPU_LOG")
if _CPU_LOG:
    import atexit
    import json

    _TEST_AT_START = os.environ.get("PYTEST_CURRENT_TEST", "")

    def _write_cpu():
        t = os.times()
        with open(_CPU_LOG, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "cpu": t.user + t.system,
                                "argv": sys.argv[:4], "test": _TEST_AT_START,
                                "pytest": "pytest" in sys.modules}) + "\n")

    atexit.register(_write_cpu)
