"""TARGET: vllm.triton_utils.dispatcher (its module-level name `vars`, which
           _rebind_kernels calls at every engine start on a platform that
           registers kernel overrides, the CPU one)

WHY: _rebind_kernels scans every module's attributes and reads
     `vars(value).get("kernel")` for any value with a `__dict__`. llvmlite's
     library wrapper (`llvmlite.binding.ffi.lib`, loaded by numba, which
     vLLM's n-gram proposer imports) answers every attribute, `__dict__`
     included, with a function wrapper: `.get` raises AttributeError. So
     after one engine with n-gram speculative decoding, every later engine
     in the process fails to start (stock vLLM 0.32 too: two n-gram LLM(...)
     in one script). Eviction now serves n-gram drafts, and the suite runs
     many engines per process.
HOW: give the module a `vars` of its own that returns an empty namespace
     where the builtin's answer is not a mapping; every other value is
     scanned as before.
UPSTREAM: read `value.__dict__` only where it is a dict (or catch the
     AttributeError) in _rebind_kernels.
"""

from __future__ import annotations


def _mapping_vars(obj):
    """builtins.vars, or {} where an object's `__dict__` is not a mapping."""
    namespace = vars(obj)
    return namespace if hasattr(namespace, "get") else {}


def apply() -> None:
    from vllm.triton_utils import dispatcher

    dispatcher.vars = _mapping_vars
