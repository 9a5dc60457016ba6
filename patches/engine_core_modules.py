"""TARGET: vllm.v1.engine.core.EngineCore.kvevict_modules (a method we add)

WHY: removing a schema must release blocks pinned in the engine core's block
     pool, which lives in another process than the API server or LLM.
HOW: a utility method: clients reach it with call_utility("kvevict_modules",
     op, arg) (in-process: directly). op "drop" releases the pins under a
     "schema/" prefix, "describe" lists pinned blocks with vLLM's ref counts.
UPSTREAM: a plugin hook for engine-core utility calls.
"""

from __future__ import annotations


def apply() -> None:
    from vllm.v1.engine.core import EngineCore

    from vllm_kvevict.integration.module_store import ModuleStore

    def kvevict_modules(self, op: str, arg: str):
        store = ModuleStore.of(self.scheduler.kv_cache_manager)
        if op == "drop":
            return store.drop(arg)
        if op == "describe":
            return store.describe()
        raise ValueError(f"unknown kvevict_modules op {op!r}")

    if hasattr(EngineCore, "kvevict_modules"):
        raise RuntimeError("EngineCore.kvevict_modules already exists")
    EngineCore.kvevict_modules = kvevict_modules
