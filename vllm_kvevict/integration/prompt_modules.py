"""Frontend of prompt modules: schemas registered per engine, PML prompts expanded.

Offline:
    from vllm_kvevict import prompt_modules as pm
    pm.register_schema(llm, open("trip.pml").read())
    llm.generate('<prompt schema="trip"><plan days="3"/><miami/>Surf spots?</prompt>')
    pm.list_schemas(llm); pm.remove_schema(llm, "trip")

Server: the routes in `integration/server_routes.py` call the async versions.

Registering a schema tokenizes it, lays out positions (vllm_kvevict.core.modules.prompt_layout)
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

Hostile input: PML is parsed in linear time with a depth limit,
DTDs refused, its size (--kv-max-pml-bytes) checked before parsing, its
elements (--kv-max-modules) while parsing, its text against max_model_len
before tokenizing; and the server runs registration and expansion on the
renderer's tokenizer thread (`off_loop`), never on the event loop. A schema
registered with a client's cache_salt is that tenant's alone
(core/modules/schema_registry.py).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import uuid

from vllm_kvevict.core.config.settings import ModuleLimits
from vllm_kvevict.core.modules.pml import PMLError, find_prompt, parse_prompt, parse_schema
from vllm_kvevict.core.modules.prompt_layout import (
    SALT_PREFIX,
    SchemaLayout,
    layout_prompt,
    layout_schema,
    salt,
    tenant,
)
from vllm_kvevict.core.modules.schema_registry import SchemaRegistry
from vllm_kvevict.integration.module_store import LAYOUT_KEY, layout_problem
from vllm_kvevict.integration.settings import eviction_config

# Layouts are only accepted from this process's own code: a client that sends
# `vllm_xargs: {"kvevict_layout": ...}` could otherwise pin or read any blocks.
_NONCE = secrets.token_hex(16)


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


def split_registry_problem(api_servers: int) -> str | None:
    """Why prompt modules cannot run behind `api_servers` API server processes,
    or None. The registry lives in one frontend process (REGISTRY), so a PML
    prompt reaching another API server than the one that registered its schema
    would be refused as unknown: an intermittent 400, depending on which
    process took the connection."""
    if api_servers <= 1:
        return None
    return (f"prompt modules need one API server: their schema registry lives in the API "
            f"server's process, and with --api-server-count {api_servers} (vLLM's default "
            f"with --data-parallel-size {api_servers}) a prompt reaching another API server "
            f"than the one that registered its schema would find none; pass "
            f"--api-server-count 1 (every data-parallel engine still serves modules)")


def _check_engine(vllm_config) -> None:
    if not vllm_config.cache_config.enable_prefix_caching:
        raise PMLError("prompt modules reuse blocks through vLLM's prefix-cache path: "
                       "start the engine without --no-enable-prefix-caching")
    split = split_registry_problem(vllm_config.parallel_config._api_process_count)
    if split:
        raise PMLError(split)
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        # Refused alone (eviction runs at PP > 1): nothing here is known to
        # break, but nothing has checked module KV at schema positions on a
        # stage after the first, and a wrong position would answer silently.
        raise PMLError(f"prompt modules are not supported with --pipeline-parallel-size "
                       f"{pp}: their KV, encoded at the schema's positions, is checked "
                       f"against a dense model on one pipeline stage only; serve them "
                       f"with --tensor-parallel-size instead")


def _tokenize(input_processor):
    tok = input_processor.tokenizer
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def _max_chars(input_processor, max_model_len: int) -> int | None:
    """Characters that can hold at most max_model_len tokens (vLLM's own bound:
    its tokenizers know their longest token), or None when unknown."""
    per_token = getattr(input_processor.tokenizer, "max_chars_per_token", None)
    return max_model_len * per_token if isinstance(per_token, int) else None


def scope_of(cache_salt) -> str:
    """The schema scope of a client's cache_salt (core/modules/schema_registry.py)."""
    if cache_salt is None:
        return ""
    if not isinstance(cache_salt, str) or not cache_salt or cache_salt.startswith(SALT_PREFIX):
        err = PMLError(f"cache_salt must be a non-empty string; values starting with "
                       f"{SALT_PREFIX!r} are reserved for prompt modules")
        err.parameter = "cache_salt"
        raise err
    return tenant(cache_salt)


def _check_size(pml: str, limits: ModuleLimits | None, what: str) -> None:
    """Refuse PML past --kv-max-pml-bytes (UTF-8 bytes; a char is at least one)."""
    if limits is not None and (len(pml) > limits.max_pml_bytes or len(
            pml.encode("utf-8", "surrogatepass")) > limits.max_pml_bytes):
        raise SchemaLimitError(413, f"the PML {what} is larger than --kv-max-pml-bytes "
                                    f"({limits.max_pml_bytes} bytes)")


def prepare_schema(pml: str, input_processor, vllm_config, limits: ModuleLimits | None = None,
                   usage: dict | None = None, cache_salt: str | None = None
                   ) -> tuple[SchemaLayout, list]:
    """Parse and lay out a schema; returns it with its encode requests
    [(prompt dict, SamplingParams)]. Reserves the name (release on failure).
    With `limits` (the server's; None offline), `usage` is the engine core's
    ModuleStore.usage(). A `cache_salt` makes it that tenant's schema."""
    from vllm import SamplingParams

    _check_engine(vllm_config)
    scope = scope_of(cache_salt)
    _check_size(pml, limits, "schema")
    schema = parse_schema(pml, limits.max_modules if limits else None)
    max_len = vllm_config.model_config.max_model_len
    layout = layout_schema(schema, _tokenize(input_processor), max_positions=max_len - 1,
                           max_chars=_max_chars(input_processor, max_len))
    layout.scope = scope
    if layout.end >= max_len:
        raise PMLError(f"schema {layout.name!r} spans {layout.end} positions; "
                       f"max_model_len is {max_len}")
    bs = vllm_config.cache_config.block_size
    admit = None if limits is None else (lambda registered: check_limits(
        limits, layout.name, registered=registered, new=layout.shared_blocks(bs),
        pinned=usage["pinned_blocks"], pool=usage["pool_blocks"]))
    REGISTRY.reserve(layout.ident, admit)
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


_finish = REGISTRY.finish


def list_schemas(engine_or_llm=None, cache_salt: str | None = None) -> list[dict]:
    """The schemas a client with `cache_salt` sees: the shared ones and its own."""
    bs = _block_size(engine_or_llm)
    return [s.summary(bs) for s in REGISTRY.visible(scope_of(cache_salt)).values()]


def get_schema(engine_or_llm, name: str, cache_salt: str | None = None) -> dict:
    """One visible schema's summary; KeyError when the client sees none of that name."""
    layout = REGISTRY.get(name, scope_of(cache_salt))
    if layout is None:
        raise KeyError(f"no schema {name!r} is registered")
    return layout.summary(_block_size(engine_or_llm))


def _block_size(engine_or_llm) -> int:
    cfg = _vllm_config(engine_or_llm) if engine_or_llm is not None else None
    return cfg.cache_config.block_size if cfg else 1


def _vllm_config(obj):
    return getattr(obj, "llm_engine", obj).vllm_config


# --- offline (LLM) ------------------------------------------------------------

def register_schema(llm, pml: str, cache_salt: str | None = None) -> dict:
    """Encode a schema's modules in `llm` (vllm.LLM); returns its summary.
    With `cache_salt`, only requests with that salt see it."""
    engine = llm.llm_engine
    _refuse_problem(_call_core(engine.engine_core, "usage", ""))
    layout, requests = prepare_schema(pml, engine.input_processor, engine.vllm_config,
                                      cache_salt=cache_salt)
    try:
        if requests:
            llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    except BaseException:
        _finish(layout, False)
        _call_core(engine.engine_core, "drop", f"{layout.ident}/")
        raise
    _finish(layout, True)
    return layout.summary(engine.vllm_config.cache_config.block_size)


def remove_schema(llm, name: str, cache_salt: str | None = None) -> int:
    """Forget a schema; its blocks return to vLLM's pool once no running request
    reads them. Returns the number of blocks the store released."""
    layout = REGISTRY.forget(name, scope_of(cache_salt))
    return _call_core(llm.llm_engine.engine_core, "drop", f"{layout.ident}/")


def pinned_modules(llm) -> dict:
    """Engine core view: key -> tokens, block ids, vLLM ref counts."""
    return _call_core(llm.llm_engine.engine_core, "describe", "")


def _refuse_problem(usage: dict) -> None:
    """The engine core's reason modules cannot be shared there (module_store.sharing_problem)."""
    if usage.get("problem"):
        raise PMLError(usage["problem"])


def _call_core(client, op: str, arg: str):
    if hasattr(client, "call_utility"):  # engine core in its own process
        return client.call_utility("kvevict_modules", op, arg)
    return client.engine_core.kvevict_modules(op, arg)  # InprocClient


# --- server (AsyncLLM) ---------------------------------------------------------

# Registrations run one at a time: the --kv-max-pinned check reads the engine
# core's pinned count, which a registration still encoding has not raised yet.
_REGISTERING = asyncio.Lock()


async def off_loop(input_processor, fn, *args):
    """`fn(*args)` on the renderer's tokenizer thread (vLLM runs tokenization
    there, one thread by default, so ours never races it on a tokenizer),
    leaving the event loop free: /health and other streams keep answering."""
    executor = getattr(getattr(input_processor, "renderer", None), "_executor", None)
    return await asyncio.get_running_loop().run_in_executor(
        executor, functools.partial(fn, *args))


async def register_schema_async(engine, pml: str, limits: ModuleLimits | None = None,
                                cache_salt: str | None = None) -> dict:
    """Encode a schema's modules through `engine` (AsyncLLM); the HTTP route
    passes the server's `limits` (SchemaLimitError when past one)."""
    async with _REGISTERING:
        usage = await engine.engine_core.call_utility_async("kvevict_modules", "usage", "")
        _refuse_problem(usage)
        layout, requests = await off_loop(engine.input_processor, prepare_schema, pml,
                                          engine.input_processor, engine.vllm_config,
                                          limits, usage, cache_salt)
        try:
            for prompt, params in requests:  # one at a time: each is a full prefill
                async for _ in engine.generate(prompt, params,
                                               f"kvevict-encode-{uuid.uuid4().hex}"):
                    pass
        except BaseException:
            _finish(layout, False)
            await engine.engine_core.call_utility_async("kvevict_modules", "drop",
                                                        f"{layout.ident}/")
            raise
        _finish(layout, True)
    return layout.summary(engine.vllm_config.cache_config.block_size)


async def remove_schema_async(engine, name: str, cache_salt: str | None = None) -> int:
    layout = REGISTRY.forget(name, scope_of(cache_salt))
    return await engine.engine_core.call_utility_async("kvevict_modules", "drop",
                                                       f"{layout.ident}/")


# --- input processing ----------------------------------------------------------

def expand(input_processor, prompt: dict, params):
    """(prompt, params) with a PML prompt rewritten; unchanged when the prompt
    holds none or was expanded already (our layout, with this process's nonce:
    the server expands off the event loop first, patches/async_llm_pml.py).
    Raises PMLError for bad PML (the caller answers 400)."""
    layout = (getattr(params, "extra_args", None) or {}).get(LAYOUT_KEY)
    if isinstance(layout, dict) and layout.get("nonce") == _NONCE:
        return prompt, params
    text = prompt.get("prompt") if prompt.get("type") == "token" else None
    split = find_prompt(text) if isinstance(text, str) and "<prompt" in text else None
    if split is None:
        return prompt, params
    before, element, after = split
    vllm_config = input_processor.vllm_config
    _check_engine(vllm_config)
    limit = vllm_config.model_config.max_model_len
    limits = eviction_config(vllm_config).limits
    try:
        _check_size(element, limits, "prompt")
    except SchemaLimitError as e:
        raise PMLError(str(e)) from None  # a prompt's is a 400, like every bad prompt
    chars = _max_chars(input_processor, limit)
    if chars is not None and len(text) > chars:
        raise PMLError(f"the prompt holds {len(text)} characters, more than fit in "
                       f"max_model_len ({limit} tokens: {chars} characters at most)")
    parsed = parse_prompt(element, limits.max_modules)
    scope = scope_of(prompt.get("cache_salt"))
    schema = REGISTRY.get(parsed.schema, scope)
    if schema is None:
        raise PMLError(f"no schema {parsed.schema!r} is registered"
                       f" (registered: {', '.join(REGISTRY.visible(scope)) or 'none'})")
    around = tuple(t if t.strip() else "" for t in (before, after))
    layout = layout_prompt(schema, parsed, _tokenize(input_processor),
                           vllm_config.cache_config.block_size,
                           lambda module: REGISTRY.owner_of(module, scope), around)
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
