"""Prompt modules against a hostile client, on a real engine (issue 20, items 3 and 4).

Cache salts: a PML request's private blocks (tails, parameter values, free
text) are found again through vLLM's prefix cache under the request's cache
salt. A client that could send that salt with a plain prompt of the same token
ids would plant blocks computed at the wrong positions for the next PML request
to read. Module salts are keyed with a server secret and carry a prefix that
client salts may not use.

Layouts: the layout in SamplingParams.extra_args is internal. Whatever form a
prompt takes (text, a dict, token ids, an EngineCoreRequest), a layout this
process did not make is refused before the engine core, and the engine core
itself refuses a malformed one (the request, not the engine, fails).
Nothing may change when a request is refused: vLLM's BlockPool is read.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
from test_prompt_modules import SCHEMA

from vllm_kvevict.integration import prompt_modules as pm
from vllm_kvevict.integration.module_store import LAYOUT_KEY
from vllm_kvevict.probe import scheduler_of

# Long enough that the PML request computes several full blocks of its own
# (the blocks a poisoned prefix cache would hand it); each test its own text,
# so that no earlier request left those blocks behind.
QUESTION = "Question: " + " ".join(f"is person {i} a baker or a pilot?" for i in range(12))


def pml(tag: str) -> str:
    return f'<prompt schema="people"><alice/><bob age="31"/>{QUESTION} ({tag}) Answer:</prompt>'


@pytest.fixture(scope="module")
def llm(engines):
    yield engines.get(dtype="float32")  # test_prompt_modules' engine: shared when adjacent
    pm.REGISTRY.schemas.clear()


@pytest.fixture
def schema(llm):
    pm.register_schema(llm, SCHEMA)
    yield pm.REGISTRY.schemas["people"]
    if "people" in pm.REGISTRY.schemas:
        pm.remove_schema(llm, "people")


def expanded(llm, text: str, **prompt) -> tuple[list[int], str, dict]:
    """What the input processor makes of a PML prompt: token ids, cache salt, layout."""
    from vllm import SamplingParams

    p, params = pm.expand(llm.llm_engine.input_processor,
                          {"type": "token", "prompt": text, "prompt_token_ids": [], **prompt},
                          SamplingParams(max_tokens=1))
    return p["prompt_token_ids"], p["cache_salt"], params.extra_args[LAYOUT_KEY]


def shared(layout: dict) -> int:
    return sum(n for _, n in layout["imports"])


def one(llm, prompt, **params):
    from vllm import SamplingParams

    params = {"max_tokens": 1, "temperature": 0, **params}
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


# --- item 3: cache salts ------------------------------------------------------------

def test_a_client_cannot_send_the_salt_a_module_prompt_gets(llm, schema):
    from vllm.exceptions import VLLMValidationError

    ids, salt, layout = expanded(llm, pml("reserved"))
    with pytest.raises(VLLMValidationError, match="reserved"):
        one(llm, {"prompt_token_ids": ids, "cache_salt": salt})
    out = one(llm, pml("reserved"))
    assert len(out.prompt_token_ids) - shared(layout) > 2 * 32  # private full blocks exist
    assert out.num_cached_tokens == shared(layout)  # the module blocks, nothing planted


def test_a_salt_computed_from_public_information_plants_nothing(llm, schema):
    """Positions and imports follow from the schema (GET /v1/kvevict/schemas
    lists it): a salt hashed from them alone is one any client can compute."""
    ids, _, layout = expanded(llm, pml("public"))
    guess = hashlib.sha256(repr((layout["positions"], layout["imports"])).encode()).hexdigest()
    planted = one(llm, {"prompt_token_ids": ids, "cache_salt": guess})
    assert planted.num_cached_tokens == 0  # computed at positions 0..n-1
    out = one(llm, pml("public"))
    assert out.num_cached_tokens == shared(layout)


def test_module_salts_are_keyed_and_keep_client_salts_apart(llm, schema, monkeypatch):
    """The salt depends on the server's key, carries the reserved prefix, and
    keeps a client's own cache_salt (tenant isolation) instead of replacing it."""
    from vllm_kvevict.core.modules.prompt_layout import SALT_KEY_ENV, SALT_PREFIX

    text = pml("tenants")
    plain, a, b = (expanded(llm, text, **extra)[1]
                   for extra in ({}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}))
    assert len({plain, a, b}) == 3
    assert all(s.startswith(SALT_PREFIX) for s in (plain, a, b))
    monkeypatch.setenv(SALT_KEY_ENV, "another server's key")
    assert expanded(llm, text)[1] != plain


def test_tenants_salting_their_requests_share_module_blocks_only(llm, schema):
    """The same PML prompt from two tenants (their own cache_salt): both read
    the module blocks; only the same tenant reads its earlier private blocks."""
    text = pml("tenant blocks")
    shared_tokens = shared(expanded(llm, text)[2])
    a, b, a_again = (one(llm, {"prompt": text, "cache_salt": t}) for t in ("a", "b", "a"))
    assert a.num_cached_tokens == b.num_cached_tokens == shared_tokens
    assert a_again.num_cached_tokens > shared_tokens


def test_processes_started_after_plugin_load_share_the_salt_key():
    """API server processes (`--api-server-count`) are spawned after the plugin
    loaded in the main process: they inherit its key, so one prompt gets one
    salt in every one of them."""
    import vllm_kvevict
    from vllm_kvevict.core.modules.prompt_layout import SALT_KEY_ENV, salt

    vllm_kvevict.register()
    assert os.environ.get(SALT_KEY_ENV)
    code = "from vllm_kvevict.core.modules.prompt_layout import salt; print(salt('prompt', [0, 1], []))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=True)
    assert child.stdout.strip() == salt("prompt", [0, 1], [])


# --- item 4: layouts on every entry path ---------------------------------------------

FORGED = {"pin": "people/alice", "positions": [0, 1, 2], "nonce": "a guess"}


def engine_request(llm, request_id: str, layout, n: int = 3):
    """An EngineCoreRequest for `n` token ids carrying `layout`, built the way
    vLLM builds one, as a caller of the EngineCoreRequest API would."""
    from vllm import SamplingParams

    ip = llm.llm_engine.input_processor
    build = type(ip).process_inputs.__kvevict_original__  # vLLM's own: checks no layout
    prompt = {"type": "token", "prompt_token_ids": list(range(100, 100 + n))}
    req = build(ip, request_id, prompt, SamplingParams(max_tokens=1),
                supported_tasks=("generate",))
    req.sampling_params.extra_args = {LAYOUT_KEY: layout}
    return req


@pytest.fixture
def unchanged(llm):
    """Asserts, after the test, that nothing was admitted and no block moved."""
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    yield
    assert not llm.llm_engine.has_unfinished_requests()
    assert pool.get_num_free_blocks() == free


@pytest.mark.parametrize("prompt", [
    "a plain string, rendered by vLLM",
    {"prompt": "a text prompt dict"},
    {"prompt_token_ids": [101, 102, 103]},
], ids=["text", "text-dict", "token-ids"])
@pytest.mark.parametrize("layout", [FORGED, "not a dict"], ids=["forged", "non-dict"])
def test_a_forged_layout_is_refused_whatever_the_prompt_form(llm, unchanged, prompt, layout):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="internal to vllm_kvevict"):
        llm.llm_engine.add_request("forged", prompt, SamplingParams(
            max_tokens=1, extra_args={LAYOUT_KEY: layout}))


def test_a_forged_layout_is_refused_in_an_engine_core_request(llm, unchanged):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    req = engine_request(llm, "forged-ecr", FORGED)
    with pytest.raises(VLLMValidationError, match="internal to vllm_kvevict"):
        llm.llm_engine.add_request("forged-ecr", req, SamplingParams(max_tokens=1))


def test_a_layout_on_prompt_embeds_is_refused(llm):
    """Embeddings carry no token ids for a module's blocks to be checked
    against. (This engine refuses embeds anyway: check the rule directly.)"""
    import torch

    from vllm_kvevict.core.modules.pml import PMLError

    req = engine_request(llm, "embeds", {**FORGED, "nonce": pm._NONCE})
    req.prompt_token_ids, req.prompt_embeds = None, torch.zeros(3, 8)
    with pytest.raises(PMLError, match="token ids"):
        pm.check_request(req, 2048)


@pytest.mark.parametrize("layout, message", [
    ("not a dict", "must be a dict"),
    ({"positions": [0, 1]}, "one position per prompt token"),
    ({"positions": [0, "1", 2]}, "one position per prompt token"),
    ({"positions": [0, 1, 1 << 20]}, "max_model_len"),
    ({"positions": [0, 1, 2], "imports": "people/alice"}, "imports"),
    ({"positions": [0, 1, 2], "imports": [["people/alice", "64"]]}, "imports"),
    ({"positions": [0, 1, 2], "pin": 7}, "pin"),
    ({"positions": [0, 1, 2], "surprise": 1}, "unknown key"),
    ({"pin": "people/alice"}, "positions"),
], ids=["non-dict", "short", "non-int", "past-max-len", "imports-str", "import-count-str",
        "pin-int", "unknown-key", "no-positions"])
def test_the_engine_core_refuses_a_malformed_layout_and_keeps_serving(
        llm, unchanged, layout, message):
    """Past the frontend (an EngineCoreRequest sent to the engine core
    directly), a malformed layout fails that one request: under the
    multiprocess engine vLLM answers a request whose preprocessing raises with
    finish_reason "error"; in-process, add_request raises. Never the scheduler."""
    req = engine_request(llm, "malformed", layout)
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.engine_core.add_request(req)
    out = one(llm, "The engine still serves:", max_tokens=4)
    assert len(out.outputs[0].token_ids) == 4


def test_a_multiprocess_engine_core_fails_only_that_request(model_path):
    """The engine core in its own process (as under `vllm serve`): the request
    ends with finish_reason "error" and the next one is served. Before the
    check, the scheduler raised and the engine core died (EngineDeadError).
    A subprocess: the suite's engines are in-process."""
    from conftest import DTYPE, HERE, kv_bytes

    proc = subprocess.run([sys.executable, os.path.join(HERE, "malformed_layout_mp.py"),
                           model_path, DTYPE, str(kv_bytes(DTYPE))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT=")[-1].splitlines()[0])
    assert result == {"bad": ["error"], "next": 4}
