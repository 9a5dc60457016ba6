"""HTTP routes for prompt-module schemas, as a vLLM endpoint plugin.

    POST   /v1/kvevict/schemas          {"pml": "<schema name=...>...</schema>",
                                         "cache_salt": "..." (optional: a tenant's own)}
    GET    /v1/kvevict/schemas          the schemas the caller sees and their modules
    GET    /v1/kvevict/schemas/{name}   one of them
    DELETE /v1/kvevict/schemas/{name}   forget it; its blocks go back to the pool
                                        once no running request reads them
    (GET and DELETE take the tenant's salt as `?cache_salt=...`)

vLLM loads endpoint plugins only when named in VLLM_PLUGINS (routes widen the
server's surface), so the server runs with VLLM_PLUGINS=kvevict,kvevict_modules.
Prompts that import modules need no route: they go to /v1/completions or
/v1/chat/completions as PML text (patches/input_processor_pml.py).

Access: vLLM's `--api-key` middleware guards every path under /v1, these
included (401 without the key; tests/test_prompt_modules_server_limits.py).
What clients may pin is bounded by --kv-max-schemas (403 past it) and
--kv-max-pinned (413), read from the server's additional_config; a body past
--kv-max-pml-bytes is 413 before it is read whole. Tenants: a schema posted with
a `cache_salt` is seen only by requests with that salt (list, get, import,
delete); one posted without is shared (core/modules/schema_registry.py).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from vllm_kvevict.core.modules.pml import PMLError
from vllm_kvevict.integration import prompt_modules as pm
from vllm_kvevict.integration.settings import eviction_config

router = APIRouter(prefix="/v1/kvevict")


_KINDS = {403: "LimitExceededError", 404: "NotFoundError", 413: "LimitExceededError"}


def _error(status: int, message: str) -> JSONResponse:
    kind = _KINDS.get(status, "BadRequestError")
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "code": status}})


async def _body(request: Request, cap: int) -> bytes | None:
    """The request body, or None once it passes `cap` bytes (read no further)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


BODY_FORM = '{"pml": "<schema ...>"}, line breaks in the PML written as \\n'


@router.post("/schemas")
async def register(request: Request):
    engine = request.app.state.engine_client
    limits = eviction_config(engine.vllm_config).limits
    raw = await _body(request, limits.max_pml_bytes)
    if raw is None:
        return _error(413, f"the body is larger than --kv-max-pml-bytes "
                           f"({limits.max_pml_bytes} bytes)")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: [[[[... past Python's stack
        # The parser's reason and place: a PML pasted with its line breaks
        # (not \n escapes) is the usual one, "Invalid control character at".
        why = "nested too deep" if isinstance(e, RecursionError) else str(e)
        return _error(400, f"body is not JSON ({why[:200]}); expected {BODY_FORM}")
    pml = body.get("pml") if isinstance(body, dict) else None
    if not isinstance(pml, str):
        return _error(400, f"body must be JSON: {BODY_FORM}")
    try:
        summary = await pm.register_schema_async(engine, pml, limits, body.get("cache_salt"))
    except PMLError as e:
        return _error(getattr(e, "status", 400), str(e))
    return JSONResponse(summary)


@router.get("/schemas")
async def list_schemas(request: Request, cache_salt: str | None = None):
    try:
        schemas = pm.list_schemas(request.app.state.engine_client, cache_salt)
    except PMLError as e:
        return _error(400, str(e))
    return JSONResponse({"schemas": schemas})


@router.get("/schemas/{name}")
async def get_schema(name: str, request: Request, cache_salt: str | None = None):
    try:
        return JSONResponse(pm.get_schema(request.app.state.engine_client, name, cache_salt))
    except PMLError as e:
        return _error(400, str(e))
    except KeyError as e:
        return _error(404, e.args[0])


@router.delete("/schemas/{name}")
async def remove(name: str, request: Request, cache_salt: str | None = None):
    try:
        released = await pm.remove_schema_async(request.app.state.engine_client, name,
                                                cache_salt)
    except PMLError as e:
        return _error(400, str(e))
    except KeyError as e:
        return _error(404, e.args[0])
    return JSONResponse({"name": name, "blocks_released": released})


class PromptModulesEndpoints:
    """`vllm.endpoint_plugins` entry point (see vllm/plugins/endpoint_plugins)."""

    name = "kvevict_modules"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        pass  # routes read app.state.engine_client, set by vLLM
