"""Prompt modules over HTTP: a real `vllm serve` with our endpoint plugin.

Schemas are registered, listed and removed at /v1/kvevict/schemas; PML
prompts go to the stock completions and chat routes. Reuse is read from vLLM's
own usage report (`prompt_tokens_details.cached_tokens`), leaks from vLLM's
`vllm:kv_cache_usage_perc`. Every bad input is a 4xx that changes nothing.
"""

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
    r = requests.delete(server.url + "/v1/kvevict/schemas/ghost", timeout=10)
    assert r.status_code == 404
    assert server.healthy()


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
