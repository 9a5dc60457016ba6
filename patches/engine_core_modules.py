"""TARGET: vllm.v1.engine.core.EngineCore.kvevict_modules (a method we add)
        and EngineCore.preprocess_add_request

WHY: removing a schema must release blocks pinned in the engine core's block
     pool, which lives in another process than the API server or LLM; the
     schema routes' --kv-max-pinned check needs the store's size. And the
     scheduler, KV manager and runner read a request's prompt-module layout
     unchecked: a malformed one (sent past the frontend, e.g. as an
     EngineCoreRequest) raised inside an engine step and killed the engine.
HOW: a utility method: clients reach it with call_utility("kvevict_modules",
     op, arg) (in-process: directly). op "drop" releases the pins under a
     "schema/" prefix, "describe" lists pinned blocks with vLLM's ref counts,
     "usage" counts pinned blocks and the pool's. preprocess_add_request
     checks the layout first (module_store.layout_problem) and raises
     ValueError: vLLM's input thread answers that request with
     finish_reason "error" and the engine keeps serving (in-process,
     add_request raises to its caller).
UPSTREAM: a plugin hook for engine-core utility calls, and one for
     validating SamplingParams.extra_args in the engine core.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.v1.engine.core import EngineCore

    from vllm_kvevict.integration.module_store import LAYOUT_KEY, ModuleStore, layout_problem

    def kvevict_modules(self, op: str, arg: str):
        store = ModuleStore.of(self.scheduler.kv_cache_manager)
        if op == "drop":
            return store.drop(arg)
        if op == "describe":
            return store.describe()
        if op == "usage":
            return store.usage()
        raise ValueError(f"unknown kvevict_modules op {op!r}")

    def preprocess_add_request(self, request):
        extra = getattr(request.sampling_params, "extra_args", None)
        layout = extra.get(LAYOUT_KEY) if isinstance(extra, dict) else None
        if layout is not None:
            problem = layout_problem(layout, request.prompt_token_ids,
                                     self.vllm_config.model_config.max_model_len)
            if problem:
                raise ValueError(f"request {request.request_id}: {problem}")
        return preprocess_add_request.__kvevict_original__(self, request)

    if hasattr(EngineCore, "kvevict_modules"):
        raise RuntimeError("EngineCore.kvevict_modules already exists")
    EngineCore.kvevict_modules = kvevict_modules
    mark_patched(EngineCore, "preprocess_add_request", preprocess_add_request)
