"""The schema routes of a real `vllm serve` (issue 20, item 5): they answer
only with the server's `--api-key`, as the OpenAI routes do, and refuse, with a
4xx naming the limit and its value, a schema past `--kv-max-schemas` or one
whose blocks would take more than `--kv-max-pinned` of the KV pool. A refused
schema encodes and pins nothing. One server for the whole module (~30 s)."""

import pytest
import requests
from test_prompt_modules import ALICE, BOB, SCHEMA

from vllm_kvevict.eval.server import Server

ENV = {"VLLM_PLUGINS": "kvevict,kvevict_modules"}
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
# SCHEMA pins 4 blocks of 32 tokens (alice 2, bob 2); BIG 4 on its own (133 tokens).
# The suite's pool is ~136 blocks, so 0.05 allows 6: BIG fits alone, not beside SCHEMA.
BIG = f'<schema name="big"><module name="both">{ALICE}{BOB}</module></schema>'


def tiny(name: str) -> str:
    return f'<schema name="{name}"><module name="m">Short: no full block.</module></schema>'


@pytest.fixture(scope="module")
def server(model_path):
    with Server(model_path, "--api-key", KEY, "--kv-max-schemas", "2",
                "--kv-max-pinned", "0.05", env=ENV) as srv:
        yield srv


def post(server, pml, headers=AUTH):
    return requests.post(server.url + "/v1/kvevict/schemas", json={"pml": pml},
                         headers=headers, timeout=120)


def names(server) -> list[str]:
    r = requests.get(server.url + "/v1/kvevict/schemas", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return [s["name"] for s in r.json()["schemas"]]


def test_the_routes_need_the_api_key(server):
    wrong = {"Authorization": "Bearer not-the-key"}
    for headers in ({}, wrong):
        assert post(server, tiny("nokey"), headers).status_code == 401
        assert requests.get(server.url + "/v1/kvevict/schemas", headers=headers,
                            timeout=10).status_code == 401
        assert requests.delete(server.url + "/v1/kvevict/schemas/nokey", headers=headers,
                               timeout=10).status_code == 401
    r = requests.post(server.url + "/v1/completions", json={"model": server.model,
                      "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 401  # the same rule as vLLM's own routes
    assert names(server) == []


def test_limits_are_4xx_naming_the_limit_and_change_nothing(server):
    assert post(server, SCHEMA).status_code == 200
    r = post(server, BIG)
    assert r.status_code == 413, r.text
    msg = r.json()["error"]["message"]
    assert "--kv-max-pinned 0.05" in msg and "'big'" in msg, msg
    assert post(server, tiny("tiny")).status_code == 200
    r = post(server, tiny("tiny2"))
    assert r.status_code == 403, r.text
    msg = r.json()["error"]["message"]
    assert "--kv-max-schemas" in msg and "is 2" in msg, msg
    assert names(server) == ["people", "tiny"]
    # Room is made by removing: BIG fits once SCHEMA's blocks are released.
    assert requests.delete(server.url + "/v1/kvevict/schemas/people", headers=AUTH,
                           timeout=30).status_code == 200
    r = post(server, BIG)
    assert r.status_code == 200, r.text
    assert post(server, tiny("tiny2")).status_code == 403  # still two schemas
    assert names(server) == ["tiny", "big"]


def test_a_client_salt_in_the_module_namespace_is_400(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1, "cache_salt": "kvevict:abc"}
    r = requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"], r.text
    body["cache_salt"] = "tenant-a"  # any other salt is the client's own business
    r = requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
