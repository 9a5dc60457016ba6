"""Frontend of prompt modules: schemas registered per engine, PML prompts expanded.

Offline:
    from vllm_kvevict import prompt_modules as pm
    pm.register_schema(llm, open("trip.pml").read())
    llm.generate('<prompt schema="trip"><plan days="3"/><miami/>Surf spots?</prompt>')
    pm.list_schemas(llm); pm.remove_schema(llm, "trip")

Server: the routes in `integration/server_routes.py` call the async versions.

Registering a schema tokenizes it, lays out positions (vllm_kvevict.core.prompt_layout)
and runs one encode request per module (its tokens at its schema positions,
max_tokens=1); the engine core pins the full blocks as the request ends
(module_store.py). A PML prompt, anywhere in a completion prompt or chat
message, is rewritten by the input processor (patches/input_processor_pml.py)
into token ids in physical order plus a layout in SamplingParams.extra_args:
the positions of every prompt token and the modules whose blocks open it.

Clients are not trusted with either: a layout must carry this process's
nonce (check_request, on every request the input processor builds), and the
cache salts of module requests are HMACs under a server key
(prompt_layout.salt) in a namespace client salts may not use. Schemas
registered over HTTP are bounded by --kv-max-schemas and --kv-max-pinned.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import uuid
from collections.abc import Callable

from vllm_kvevict.core.config import ModuleLimits
from vllm_kvevict.core.pml import PMLError, find_prompt, parse_prompt, parse_schema
from vllm_kvevict.core.prompt_layout import (
    SALT_PREFIX,
    SchemaLayout,
    layout_prompt,
    layout_schema,
    salt,
)
from vllm_kvevict.integration.module_store import LAYOUT_KEY, layout_problem

# Layouts are only accepted from this process's own code: a client that sends
# `vllm_xargs: {"kvevict_layout": ...}` could otherwise pin or read any blocks.
_NONCE = secrets.token_hex(16)


class SchemaRegistry:
    """The schemas this frontend process has registered (name -> layout)."""

    def __init__(self) -> None:
        self.schemas: dict[str, SchemaLayout] = {}
        self.pending: set[str] = set()  # being encoded
        self.lock = threading.Lock()

    def reserve(self, name: str, admit: Callable[[int], None] | None = None) -> None:
        """Claim `name`; `admit(schemas registered or pending)` may refuse it
        (raises), under the same lock, so two registrations cannot both pass."""
        with self.lock:
            if name in self.schemas or name in self.pending:
                raise PMLError(f"schema {name!r} is already registered; remove it first")
            if admit is not None:
                admit(len(self.schemas) + len(self.pending))
            self.pending.add(name)

    def owner_of(self, module: str) -> str | None:
        return next((s.name for s in self.schemas.values() if module in s.units), None)


REGISTRY = SchemaRegistry()


class SchemaLimitError(PMLError):
    """A schema refused by --kv-max-schemas (403) or --kv-max-pinned (413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_limits(limits: ModuleLimits, name: str, *, registered: int, pinned: int, new: int,
                 pool: int) -> None:
    """Refuse schema `name` (pinning `new` blocks) when `registered` schemas
    exist already or `pinned` blocks of the `pool` are held by modules."""
    if registered >= limits.max_schemas:
        raise SchemaLimitError(403, f"schema {name!r} refused: {registered} schemas are "
                                    f"registered and --kv-max-schemas is {limits.max_schemas}; "
                                    f"remove one first")
    cap = int(limits.max_pinned * pool)
    if pinned + new > cap:
        raise SchemaLimitError(413, f"schema {name!r} would pin {new} KV blocks and {pinned} are "
                                    f"pinned already; --kv-max-pinned {limits.max_pinned:g} "
                                    f"allows {cap} of the pool's {pool} blocks")


def _check_engine(vllm_config) -> None:
    if not vllm_config.cache_config.enable_prefix_caching:
        raise PMLError("prompt modules reuse blocks through vLLM's prefix-cache path: "
                       "start the engine without --no-enable-prefix-caching")


def _tokenize(input_processor):
    tok = input_processor.tokenizer
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def prepare_schema(pml: str, input_processor, vllm_config, limits: ModuleLimits | None = None,
                   usage: dict | None = None) -> tuple[SchemaLayout, list]:
    """Parse and lay out a schema; returns it with its encode requests
    [(prompt dict, SamplingParams)]. Reserves the name (release on failure).
    With `limits`, `usage` is the engine core's ModuleStore.usage()."""
    from vllm import SamplingParams

    _check_engine(vllm_config)
    layout = layout_schema(parse_schema(pml), _tokenize(input_processor))
    if layout.end >= vllm_config.model_config.max_model_len:
        raise PMLError(f"schema {layout.name!r} spans {layout.end} positions; "
                       f"max_model_len is {vllm_config.model_config.max_model_len}")
    bs = vllm_config.cache_config.block_size
    admit = None if limits is None else (lambda registered: check_limits(
        limits, layout.name, registered=registered, new=layout.shared_blocks(bs),
        pinned=usage["pinned_blocks"], pool=usage["pool_blocks"]))
    REGISTRY.reserve(layout.name, admit)
    requests = []
    for unit in layout.units.values():
        if len(unit.tokens) >= bs:  # shorter units have no full block to share
            key = layout.key(unit.name)
            args = {LAYOUT_KEY: {"pin": key, "positions": unit.positions, "nonce": _NONCE}}
            prompt = {"prompt_token_ids": unit.tokens,
                      "cache_salt": salt("encode", key, unit.positions)}
            requests.append((prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                    extra_args=args)))
    return layout, requests


def _finish(layout: SchemaLayout, ok: bool) -> None:
    with REGISTRY.lock:
        REGISTRY.pending.discard(layout.name)
        if ok:
            REGISTRY.schemas[layout.name] = layout


def _forget(name: str) -> None:
    with REGISTRY.lock:
        if name not in REGISTRY.schemas:
            raise KeyError(f"no schema {name!r} is registered")
        del REGISTRY.schemas[name]


def list_schemas(engine_or_llm=None) -> list[dict]:
    cfg = _vllm_config(engine_or_llm) if engine_or_llm is not None else None
    bs = cfg.cache_config.block_size if cfg else 1
    return [s.summary(bs) for s in REGISTRY.schemas.values()]


def _vllm_config(obj):
    return getattr(obj, "llm_engine", obj).vllm_config


# --- offline (LLM) ------------------------------------------------------------

def register_schema(llm, pml: str) -> dict:
    """Encode a schema's modules in `llm` (vllm.LLM); returns its summary."""
    engine = llm.llm_engine
    layout, requests = prepare_schema(pml, engine.input_processor, engine.vllm_config)
    try:
        if requests:
            llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    except BaseException:
        _finish(layout, False)
        _call_core(engine.engine_core, "drop", f"{layout.name}/")
        raise
    _finish(layout, True)
    return layout.summary(engine.vllm_config.cache_config.block_size)


def remove_schema(llm, name: str) -> int:
    """Forget a schema; its blocks return to vLLM's pool once no running request
    reads them. Returns the number of blocks the store released."""
    _forget(name)
    return _call_core(llm.llm_engine.engine_core, "drop", f"{name}/")


def pinned_modules(llm) -> dict:
    """Engine core view: key -> tokens, block ids, vLLM ref counts."""
    return _call_core(llm.llm_engine.engine_core, "describe", "")


def _call_core(client, op: str, arg: str):
    if hasattr(client, "call_utility"):  # engine core in its own process
        return client.call_utility("kvevict_modules", op, arg)
    return client.engine_core.kvevict_modules(op, arg)  # InprocClient


# --- server (AsyncLLM) ---------------------------------------------------------

# Registrations run one at a time: the --kv-max-pinned check reads the engine
# core's pinned count, which a registration still encoding has not raised yet.
_REGISTERING = asyncio.Lock()


async def register_schema_async(engine, pml: str, limits: ModuleLimits | None = None) -> dict:
    """Encode a schema's modules through `engine` (AsyncLLM); the HTTP route
    passes the server's `limits` (SchemaLimitError when past one)."""
    async with _REGISTERING:
        usage = None
        if limits is not None:
            usage = await engine.engine_core.call_utility_async("kvevict_modules", "usage", "")
        layout, requests = prepare_schema(pml, engine.input_processor, engine.vllm_config,
                                          limits, usage)
        try:
            for prompt, params in requests:  # one at a time: each is a full prefill
                async for _ in engine.generate(prompt, params,
                                               f"kvevict-encode-{uuid.uuid4().hex}"):
                    pass
        except BaseException:
            _finish(layout, False)
            await engine.engine_core.call_utility_async("kvevict_modules", "drop",
                                                        f"{layout.name}/")
            raise
        _finish(layout, True)
    return layout.summary(engine.vllm_config.cache_config.block_size)


async def remove_schema_async(engine, name: str) -> int:
    _forget(name)
    return await engine.engine_core.call_utility_async("kvevict_modules", "drop", f"{name}/")


# --- input processing ----------------------------------------------------------

def expand(input_processor, prompt: dict, params):
    """(prompt, params) with a PML prompt rewritten; unchanged when the prompt
    holds none. Raises PMLError for bad PML (the caller answers 400)."""
    text = prompt.get("prompt") if prompt.get("type") == "token" else None
    split = find_prompt(text) if isinstance(text, str) and "<prompt" in text else None
    if split is None:
        return prompt, params
    before, element, after = split
    vllm_config = input_processor.vllm_config
    _check_engine(vllm_config)
    parsed = parse_prompt(element)
    schema = REGISTRY.schemas.get(parsed.schema)
    if schema is None:
        raise PMLError(f"no schema {parsed.schema!r} is registered"
                       f" (registered: {', '.join(REGISTRY.schemas) or 'none'})")
    around = tuple(t if t.strip() else "" for t in (before, after))
    layout = layout_prompt(schema, parsed, _tokenize(input_processor),
                           vllm_config.cache_config.block_size, REGISTRY.owner_of, around)
    limit = vllm_config.model_config.max_model_len
    end = max(layout.positions) + 1
    params = params.clone()
    if params.max_tokens is None:
        params.max_tokens = limit - end
    if end + params.max_tokens > limit:
        raise PMLError(f"the prompt's last position is {end - 1} and max_tokens is "
                       f"{params.max_tokens}: positions would pass max_model_len ({limit})")
    params.extra_args = {**(params.extra_args or {}), LAYOUT_KEY: {
        "positions": layout.positions, "imports": layout.imports, "nonce": _NONCE}}
    # The salt keeps these blocks out of other requests' prefix-cache hits
    # (the same tokens at other positions hold other keys) and lets a later
    # request with this layout find them. It is keyed, so a client cannot
    # compute it and plant blocks under it; the client's own salt goes in,
    # so tenants that salt their requests stay apart.
    cache_salt = salt("prompt", layout.positions, layout.imports, prompt.get("cache_salt"))
    return {**prompt, "prompt_token_ids": layout.token_ids, "cache_salt": cache_salt}, params


def check_request(request, max_model_len: int | None) -> None:
    """Refuse an EngineCoreRequest (whatever prompt form it came from) whose
    layout this process did not make or that does not fit its prompt, or
    whose cache salt is in the module namespace without being a module request."""
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    layout = extra.get(LAYOUT_KEY)
    if layout is None:
        if isinstance(request.cache_salt, str) and request.cache_salt.startswith(SALT_PREFIX):
            err = PMLError(f"cache_salt values starting with {SALT_PREFIX!r} are reserved "
                           f"for prompt modules")
            err.parameter = "cache_salt"
            raise err
        return
    if not isinstance(layout, dict) or layout.get("nonce") != _NONCE:
        raise PMLError(f"{LAYOUT_KEY} is internal to vllm_kvevict; send a PML prompt instead")
    problem = layout_problem(layout, request.prompt_token_ids, max_model_len)
    if problem:
        raise PMLError(problem)
