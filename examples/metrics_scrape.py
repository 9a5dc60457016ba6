"""Start `vllm serve` with H2O at a 64-token budget, stream one 400-token
completion, and print the eviction series on /metrics 300 tokens in.

    python examples/metrics_scrape.py [MODEL]
"""

import sys

import requests

from vllm_kvevict.eval.server import Server  # the loopback `vllm serve` the tests use
from vllm_kvevict.models import ensure_smollm2

model = sys.argv[1] if len(sys.argv) > 1 else ensure_smollm2()
with Server(model, "--kv-eviction", "h2o", "--kv-budget", "64") as srv:
    body = {"model": model, "prompt": "The history of the lighthouse began",
            "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=300) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data:"))
        for i, _ in enumerate(events):
            if i == 300:
                text = requests.get(srv.url + "/metrics", timeout=10).text
    print("\n".join(line for line in text.splitlines() if line.startswith("vllm_kvevict")))
