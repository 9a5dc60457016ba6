"""Prompt modules over HTTP: a real `vllm serve` with our endpoint plugin.

Schemas are registered, listed and removed at /v1/kvevict/schemas; PML
prompts go to the stock completions and chat routes. Reuse is read from vLLM's
own usage report (`prompt_tokens_details.cached_tokens`), leaks from vLLM's
`vllm:kv_cache_usage_perc`. Every bad input is a 4xx that changes nothing.
"""

import threading
import time

import pytest
import requests
from vllm_kvevict.eval.server import Server
from test_prompt_modules import PROMPT, SCHEMA

ENV = {"VLLM_PLUGINS": "kvevict,kvevict_modules"}  # endpoint plugins are opt-in in vLLM


@pytest.fixture(scope="module")
def server(model_path):
    with Server(model_path, "--enable-prompt-tokens-details", env=ENV) as srv:
        r = requests.post(srv.url + "/v1/kvevict/schemas", json={"pml": SCHEMA}, timeout=120)
        assert r.status_code == 200, r.text
        srv.summary = r.json()
        yield srv


def complete(server, prompt, **body):
    return server.complete(prompt, max_tokens=8, **body)


def chat(server, content, **body):
    body = {"model": server.model, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": content}], **body}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def cached(response) -> int:
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def test_register_and_list(server):
    shared = {m["name"]: m["shared_tokens"] for m in server.summary["modules"]}
    assert shared["alice"] == 64 and shared["bob"] == 64
    listed = requests.get(server.url + "/v1/kvevict/schemas", timeout=10).json()
    assert [s["name"] for s in listed["schemas"]] == ["people"]


def test_completions_and_chat_reuse_module_blocks(server):
    r = complete(server, PROMPT)
    assert r.status_code == 200, r.text
    assert cached(r) == 128  # alice's and bob's full blocks, not recomputed
    again = complete(server, PROMPT)
    assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    c = chat(server, PROMPT)
    assert c.status_code == 200, c.text
    assert cached(c) == 128 and c.json()["choices"][0]["message"]["content"]


BAD = [
    ('<prompt schema="people"><alice/>', "never closed"),
    ('<prompt schema="people"><alice></prompt>', "malformed PML"),
    ('<prompt schema="ghosts"><alice/></prompt>', "no schema 'ghosts'"),
    ('<prompt schema="people"><carol/></prompt>', "no module 'carol'"),
    ('<prompt schema="people"><bob age="one two three four five six seven"/></prompt>',
     "its len is 6"),
    ('<prompt schema="people"><alice/></prompt><prompt schema="other"/>', "cannot mix schemas"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_prompts_are_400_and_change_nothing(server, route):
    good = complete(server, PROMPT).json()["choices"][0]["text"]
    send = complete if route == "completions" else chat
    for bad, message in BAD:
        r = send(server, bad)
        assert r.status_code == 400, (bad, r.text)
        assert message in r.json()["error"]["message"], (bad, r.text)
    assert server.healthy()
    assert complete(server, PROMPT).json()["choices"][0]["text"] == good


def test_bad_schemas_are_400(server):
    post = lambda body: requests.post(server.url + "/v1/kvevict/schemas", json=body, timeout=60)
    for body, message in [({"pml": SCHEMA}, "already registered"),
                          ({"pml": "<schema name='x'><module>no name</module></schema>"},
                           "needs a name"),
                          ({"pml": "<schema name='x'><module name='a'>open</schema>"},
                           "malformed PML"),
                          ({"schema": "missing pml"}, "body must be JSON")]:
        r = post(body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    # A schema pasted into a JSON string with its line breaks (not \n escapes):
    # the answer says why the body is not JSON, and how to write it.
    raw = '{"pml": "<schema name=\'x\'>\n<module name=\'a\'>A</module></schema>"}'
    r = requests.post(server.url + "/v1/kvevict/schemas", data=raw.encode(), timeout=60,
                      headers={"Content-Type": "application/json"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "Invalid control character" in message, r.text
    assert "line breaks in the PML written as \\n" in message, message
    r = requests.delete(server.url + "/v1/kvevict/schemas/ghost", timeout=10)
    assert r.status_code == 404
    assert server.healthy()


# --- issue 38: one hostile request must not stall the server ------------------------

class Health:
    """Polls /health from a thread while a hostile request runs; `worst` is the
    longest any poll waited (a poll that timed out counts its full wait)."""

    def __init__(self, server):
        self.url, self.waits, self.done = server.url + "/health", [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self.done.is_set():
            start = time.monotonic()
            try:
                ok = requests.get(self.url, timeout=10).status_code == 200
            except requests.RequestException:
                ok = False
            self.waits.append(time.monotonic() - start if ok else 10.0)
            time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        while not self.waits:  # the poller runs before the request goes out
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    @property
    def worst(self) -> float:
        return max(self.waits)


def hostile(server, send, limit=5.0, undo=None):
    """`send()` with /health polled meanwhile: its response, which must come within
    `limit` seconds while /health never waits a second. A request the old code held
    for minutes times out at 60 s (a test failure).

    A /health stall is measured twice before it fails: the stalls this guards
    against (a cubic regex, a DTD expanded on the event loop) recur on every
    try, while on a loaded 2-core CI machine one poll in forty once waited
    1.3 s with the others at 10 ms. `undo()` (if given) runs between the tries."""
    for attempt in (1, 2):
        with Health(server) as health:
            start = time.monotonic()
            r = send()
            took = time.monotonic() - start
        print(f"try {attempt}: {took:.2f} s (limit {limit:.2f}), /health worst "
              f"{health.worst:.3f} s over {len(health.waits)} polls")
        assert took < limit, took
        if health.worst < 1.0:
            return r
        if undo is not None:
            undo()
    raise AssertionError(f"/health stalled on both tries: {health.waits}")


def timed(send):
    start = time.monotonic()
    r = send()
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def post_schema(server, pml, **body):
    return requests.post(server.url + "/v1/kvevict/schemas", json={"pml": pml, **body},
                         timeout=60)


NEWLINES = "a" + "\n" * 2500 + "b"  # 628 tokens; the old regex was cubic in the run
WORDS = "a" + " word" * 626 + " b"  # 628 tokens of ordinary text: the same prefill


def test_a_run_of_newlines_neither_stalls_nor_fails(server):
    """Issue 38 #1: 23.6 s (schema) and 26 s (prompt) with /health blocked. Both
    requests prefill 628 tokens, which alone took 3.0-5.2 s on an AVX2-only CPU
    in bf16, so each is held to twice (+1 s) the same request made of words."""
    url = server.url + "/v1/kvevict/schemas/ws"
    schema = lambda text: post_schema(server, f'<schema name="ws">{text}</schema>')
    prompt = lambda text: complete(server, f'<prompt schema="people"><alice/>{text}</prompt>')
    try:
        words = timed(lambda: schema(WORDS))
        assert requests.delete(url, timeout=30).ok
        r = hostile(server, lambda: schema(NEWLINES), limit=2 * words + 1,
                    undo=lambda: requests.delete(url, timeout=30))
        assert r.status_code == 200, r.text
        words = timed(lambda: prompt(WORDS))
        # A second try (a /health stall) sends a fresh run: a repeat would read
        # the first try's own blocks back from the prefix cache (CI saw 704).
        first = iter("ac")
        r = hostile(server, lambda: prompt(next(first) + NEWLINES[1:]), limit=2 * words + 1)
        assert r.status_code == 200, r.text
        assert cached(r) == 64  # alice's full blocks, read
    finally:  # gone whatever failed, or every later test sees a second schema
        gone = requests.delete(url, timeout=30)
    assert gone.ok, gone.text


DTD = ('<!DOCTYPE s [<!ENTITY e "' + "x" * 8000 + '">]><schema name="dtd">'
       + "&e;" * 1000 + "</schema>")
DEEP_MODULES = ('<schema name="deep">' + "".join(f'<module name="m{i}">t' for i in range(3000))
                + "</module>" * 3000 + "</schema>")
DEEP_UNIONS = ('<schema name="deep">' + "".join(f'<union><module name="u{i}">t'
                                                for i in range(1500))
               + "</module></union>" * 1500 + "</schema>")
WIDE = ('<schema name="wide"><union>' + "".join(f'<module name="m{i}">x</module>'
                                                for i in range(20_000)) + "</union></schema>")
HUGE = '<schema name="huge">' + "word " * 220_000 + "</schema>"  # > 1 MiB

HOSTILE_SCHEMAS = {
    "dtd": (DTD, 400, "DTDs and entity declarations are refused"),
    "modules 3,000 deep": (DEEP_MODULES, 400, "depth limit (64)"),
    "unions 1,500 deep": (DEEP_UNIONS, 400, "depth limit (64)"),
    "union of 20,000": (WIDE, 400, "--kv-max-modules is 512"),
    "body over 1 MiB": (HUGE, 413, "--kv-max-pml-bytes (1048576 bytes)"),
}


@pytest.mark.parametrize("case", list(HOSTILE_SCHEMAS))
def test_hostile_schemas_are_4xx_at_once(server, case):
    """Issue 38 #2, #4: a DTD was expanded (4.8 s stall), 20,000 members accepted,
    deep nesting a 500 (RecursionError); nothing was bounded before parsing."""
    pml, status, message = HOSTILE_SCHEMAS[case]
    r = hostile(server, lambda: post_schema(server, pml))
    assert r.status_code == status and message in r.json()["error"]["message"], r.text[:500]
    names = [s["name"] for s in requests.get(server.url + "/v1/kvevict/schemas",
                                             timeout=10).json()["schemas"]]
    assert names == ["people"]


def test_hostile_prompts_are_400_at_once_and_serving_goes_on(server):
    """Within max_model_len (vLLM refuses longer text itself): 300 deep (1,209
    tokens), 600 imports (1,809)."""
    deep, wide = "<a>" * 300 + "</a>" * 300, "<a/>" * 600
    for body, message in ((deep, "depth limit (64)"), (wide, "--kv-max-modules is 512")):
        r = hostile(server, lambda: complete(server, f'<prompt schema="people">{body}</prompt>'))
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = complete(server, PROMPT)
    assert r.status_code == 200 and cached(r) == 128, r.text


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_truncating_a_module_prompt_is_400_naming_why(server, route):
    """Issue 38 #5: truncate_prompt_tokens was silently ignored (5 asked, 185 sent)."""
    send = complete if route == "completions" else chat
    r = send(server, PROMPT, truncate_prompt_tokens=5)
    assert r.status_code == 400, r.text
    assert "truncate_prompt_tokens cannot apply to a prompt-module" in r.text, r.text
    assert send(server, "A plain prompt.", truncate_prompt_tokens=5).status_code == 200


def test_a_salted_schema_is_the_tenants_alone(server):
    """Issue 38 #6: any client could list, import and delete any schema."""
    url = server.url + "/v1/kvevict/schemas"
    mine = SCHEMA.replace('name="people"', 'name="mine"')  # module names may repeat
    r = post_schema(server, mine, cache_salt="tenant-a")
    assert r.status_code == 200 and r.json()["shared"] is False, r.text
    try:
        listed = lambda **q: [s["name"] for s in requests.get(url, params=q, timeout=10)
                              .json()["schemas"]]
        assert listed() == ["people"] and listed(cache_salt="tenant-b") == ["people"]
        assert listed(cache_salt="tenant-a") == ["people", "mine"]
        assert requests.get(url + "/mine", timeout=10).status_code == 404
        assert requests.get(url + "/mine", params={"cache_salt": "tenant-a"},
                            timeout=10).status_code == 200
        prompt = '<prompt schema="mine"><alice/>Who is Alice?</prompt>'
        for salt in (None, "tenant-b"):
            r = complete(server, prompt, **({"cache_salt": salt} if salt else {}))
            assert r.status_code == 400 and "no schema 'mine'" in r.text, r.text
            assert "mine" not in r.json()["error"]["message"].split("registered:")[1]
        r = complete(server, prompt, cache_salt="tenant-a")
        assert r.status_code == 200 and cached(r) == 64, r.text
        r = complete(server, PROMPT, cache_salt="tenant-a")  # shared: everyone's
        assert r.status_code == 200, r.text
        assert requests.delete(url + "/mine", timeout=10).status_code == 404
        assert requests.delete(url + "/mine", params={"cache_salt": "tenant-b"},
                               timeout=10).status_code == 404
    finally:
        r = requests.delete(url + "/mine", params={"cache_salt": "tenant-a"}, timeout=30)
    assert r.status_code == 200 and r.json()["blocks_released"] == 4, r.text
    assert listed(cache_salt="tenant-a") == ["people"]


def test_pml_work_runs_off_the_event_loop():
    """Registration and a rendered PML prompt's expansion run on the renderer's
    tokenizer thread, not the event loop's (no server: stand-ins record the
    thread that reads them, then refuse, which ends the request)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_kvevict
    from vllm_kvevict.integration import prompt_modules as pm

    vllm_kvevict.register()
    seen = []

    class Config:
        @property
        def cache_config(self):
            seen.append(threading.current_thread())
            raise pm.PMLError("stop here")

    executor = ThreadPoolExecutor(1)
    processor = SimpleNamespace(renderer=SimpleNamespace(_executor=executor), vllm_config=Config())
    async def usage(*args):  # the engine core's ModuleStore.usage(): modules can be shared
        return {"problem": None}

    engine = SimpleNamespace(input_processor=processor, vllm_config=Config(),
                             engine_core=SimpleNamespace(call_utility_async=usage))
    prompt = {"type": "token", "prompt": '<prompt schema="s">hi</prompt>', "prompt_token_ids": []}

    async def both():
        with pytest.raises(VLLMValidationError, match="stop here"):
            await AsyncLLM.add_request(engine, "r", prompt, SamplingParams())
        with pytest.raises(pm.PMLError, match="stop here"):
            await pm.register_schema_async(engine, "<schema/>")
        return threading.current_thread()

    loop_thread = asyncio.run(both())
    (worker,) = executor._threads
    assert seen == [worker, worker] and loop_thread is not worker


def test_remove_returns_blocks_to_the_pool(server):
    # Runs last in this module: the schema is gone afterwards.
    for _ in range(40):  # usage is reported once per engine step
        if server.metric("vllm:num_requests_running") == 0:
            break
        time.sleep(0.5)
    assert server.metric("vllm:kv_cache_usage_perc") > 0  # the pinned module blocks
    r = requests.delete(server.url + "/v1/kvevict/schemas/people", timeout=30)
    assert r.status_code == 200 and r.json()["blocks_released"] == 4, r.text
    complete(server, "One more plain request, so that vLLM reports usage again.")
    for _ in range(40):
        if server.metric("vllm:kv_cache_usage_perc") == 0.0:
            break
        time.sleep(0.5)
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    r = complete(server, PROMPT)
    assert r.status_code == 400 and "no schema 'people'" in r.json()["error"]["message"]
