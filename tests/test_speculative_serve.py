"""`vllm serve MODEL --kv-eviction h2o --speculative-config '{"method": "ngram", ...}'`,
as a user types it: a real server evicts and speculates at once.

Requests over the budget, several at a time, streamed: vLLM's own counters
say drafts were proposed and accepted, the plugin's that every request's overflow was evicted, a
request's resident KV stays within the budget while it streams, and once the
server is idle vLLM's `vllm:kv_cache_usage_perc` is 0 (no block leaked). The
token-level proofs (H2O's kept sets against the dense reference, identity to
stock with drafts) are tests/test_speculative_decoding.py's, offline.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

BUDGET = 64
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
PROMPTS = ["Repeat this list three times: apple, banana, cherry, date, elderberry, fig.",
           "Count from one to fifty in words, separated by commas.",
           "Write a Python function that sorts a list with merge sort, then test it."]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def server(model_path):
    from vllm_kvevict.eval.server import Server

    with Server(model_path, "--kv-eviction", "h2o", "--kv-budget", str(BUDGET),
                "--speculative-config", json.dumps(SPEC)) as srv:
        yield srv


def _streamed_resident(server, prompt: str, from_tokens: int
                       ) -> tuple[list[tuple[float, float]], int]:
    """Stream one completion; (logical, physical) resident tokens on /metrics,
    read about every 0.1 s from when it has `from_tokens` tokens (an event may
    carry several: accepted drafts) to its end, and its completion token
    count. Several reads, not one: the scheduler writes the gauges at most
    once a second while requests run, so a single read can still show the
    step that admitted them (0 tokens computed)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    seen, tokens, last = [], 0, 0.0
    with requests.post(server.url + "/v1/completions", json=body, stream=True,
                       timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            data = line.removeprefix(b"data:").strip()
            if not data or data == b"[DONE]":
                continue
            tokens = (json.loads(data).get("usage") or {}).get("completion_tokens", tokens)
            if tokens >= from_tokens and time.monotonic() - last > 0.1:
                last = time.monotonic()
                seen.append((server.metric('vllm_kvevict_resident_tokens{kind="logical"}'),
                             server.metric('vllm_kvevict_resident_tokens{kind="physical"}')))
    assert seen, tokens
    return seen, tokens


def test_a_served_engine_evicts_and_speculates(server):
    drafts0 = server.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted0 = server.metric("vllm:spec_decode_num_accepted_tokens_total")
    evicted0 = server.metric("vllm_kvevict_tokens_evicted_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        plain = [pool.submit(server.complete, p, max_tokens=MAX_TOKENS, ignore_eos=True)
                 for p in PROMPTS[1:]]
        resident, streamed = _streamed_resident(server, PROMPTS[0], from_tokens=150)
        answers = [f.result() for f in plain]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in answers)
    assert streamed == MAX_TOKENS
    # Mid-stream, three requests well past the budget: each holds at most the
    # budget (the gauge sums the running requests), in the first read that
    # the scheduler wrote after they started.
    logical, physical = next(((lg, ph) for lg, ph in resident if lg > 0), (0.0, 0.0))
    assert logical > 3 * BUDGET and 0 < physical <= 3 * BUDGET, resident

    m = server.wait_idle()
    drafts = server.metric("vllm:spec_decode_num_draft_tokens_total") - drafts0
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total") - accepted0
    assert 0 < accepted < drafts, (accepted, drafts)  # vLLM's own verifier counts
    # each request saw > prompt + MAX_TOKENS tokens and kept at most the budget
    assert server.metric("vllm_kvevict_tokens_evicted_total") - evicted0 \
        >= len(PROMPTS) * (MAX_TOKENS - BUDGET)
    assert server.metric("vllm_kvevict_resident_tokens") == 0
    usage = [v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc")]
    assert usage == [0.0], "a block leaked"
    assert server.healthy()
