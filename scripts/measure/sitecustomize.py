"""Measuring aids for the test suite, in every process of a run (a sitecustomize).

Count vLLM engine starts:

    PYTHONPATH=scripts/measure KVEVICT_ENGINE_LOG=/tmp/engines.log .venv/bin/python -m pytest
    .venv/bin/python scripts/measure/engine_summary.py /tmp/engines.log

Run as an AVX2-only CPU would (CI machines of this kind differ: some have no
AVX-512, and bf16 is several times slower there), on a machine that has AVX-512:

    PYTHONPATH=scripts/measure KVEVICT_AS_AVX2=1 .venv/bin/python -m pytest

(torch's kernels dispatch at AVX2, oneDNN stops at AVX2, and vLLM loads its
AVX2 build and picks the ISA it picks on such a CPU.)

Python imports `sitecustomize` at startup from PYTHONPATH, in the test process
and in every child it starts (servers, engine cores, TP workers), so each
`EngineCore.__init__` (in-process or in its own process) appends one line:
pid, time, and the pytest test that was running (PYTEST_CURRENT_TEST is
inherited by children). Nothing happens without KVEVICT_ENGINE_LOG.
"""

import os
import sys

if os.environ.get("KVEVICT_AS_AVX2") == "1":
    # Read by torch and oneDNN when they load, so set before anything imports torch.
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    try:
        import torch.cpu as _cpu  # what vLLM asks before loading _C / _C_AVX2 and picking amx

        _cpu._is_avx512_supported = lambda: False
        _cpu._is_avx512_bf16_supported = lambda: False
        _cpu._is_amx_tile_supported = lambda: False
    except ImportError:
        pass

_LOG = os.environ.get("KVEVICT_ENGINE_LOG")

if _LOG:
    import importlib.abc
    import importlib.util
    import json
    import time

    _TARGET = "vllm.v1.engine.core"

    class _CountEngineCores(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module):
                exec_module(module)
                init = module.EngineCore.__init__

                def counted_init(self, *args, **kwargs):
                    with open(_LOG, "a") as f:
                        f.write(json.dumps({"pid": os.getpid(), "t": time.time(),
                                            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                            "argv": sys.argv[:4]}) + "\n")
                    return init(self, *args, **kwargs)

                module.EngineCore.__init__ = counted_init

            spec.loader.exec_module = exec_and_wrap
            return spec

    sys.meta_path.insert(0, _CountEngineCores())
