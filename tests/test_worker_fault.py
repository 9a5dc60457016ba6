"""A model process killed mid-run: the server fails the way stock vLLM does,
does not hang, and a restart serves again.

With TP 1, vLLM's API server runs the model in one child process, the
EngineCore (busy loop, scheduler, KV managers and the worker). The test
SIGKILLs it while three streams are generating, under stock vLLM and under the
plugin with eviction on, and records what a client sees: how each stream ends,
what /health says, and whether the API server exits. Every wait is bounded, so
a hang fails the test instead of blocking it.
"""

import signal
import threading
import time

import psutil
import pytest
import requests
from server import Server

PROMPT = "Write a very long story about a lighthouse keeper and the sea."
ENDED_WITHIN = 60.0  # seconds for streams to end and the server to react


def stream(server, out: dict, key: int) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    tokens, last = 0, None
    try:
        with requests.post(server.url + "/v1/completions", json=body, stream=True,
                           timeout=ENDED_WITHIN) as r:
            for line in r.iter_lines():
                if line.startswith(b"data:"):
                    tokens += 1
                    last = line
        out[key] = ("closed", tokens, (last or b"")[:200].decode(errors="replace"))
    except requests.RequestException as e:
        out[key] = ("error", tokens, type(e).__name__)


def engine_core(server) -> psutil.Process:
    children = psutil.Process(server.proc.pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert len(cores) == 1, [(p.pid, p.name(), p.cmdline()) for p in children]
    return cores[0]


def kill_engine_mid_run(server) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(server, out, i)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(8)  # streams are generating by now (engine start is long past)
    core = engine_core(server)
    core.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(ENDED_WITHIN)
    streams_ended = all(not t.is_alive() for t in threads)
    exited = None
    try:
        server.proc.wait(ENDED_WITHIN)
        exited = server.proc.returncode
    except Exception:
        pass
    return {"streams_ended": streams_ended, "seconds": round(time.monotonic() - killed, 1),
            "streams": [out.get(i) for i in range(3)], "server_exit": exited,
            "healthy_after": server.healthy(),
            "orphans": [p.pid for p in psutil.process_iter() if p.pid == core.pid
                        and p.status() != psutil.STATUS_ZOMBIE]}


@pytest.fixture(scope="module")
def outcomes(model_path):
    result = {}
    for name, args, stock in (("stock", (), True),
                              ("h2o", ("--kv-eviction", "h2o", "--kv-budget", "64"), False)):
        with Server(model_path, *args, stock=stock) as srv:
            result[name] = kill_engine_mid_run(srv)
            result[name]["log"] = srv.log()[-3000:]
    return result


@pytest.mark.parametrize("name", ["stock", "h2o"])
def test_killed_engine_ends_streams_and_server(outcomes, name):
    o = outcomes[name]
    assert o["streams_ended"], o  # no client left hanging
    assert all(s is not None and s[1] > 0 for s in o["streams"]), o["streams"]
    assert not o["healthy_after"]
    assert o["server_exit"] is not None, "API server still running after its engine died"
    assert not o["orphans"]


def test_plugin_fails_like_stock(outcomes):
    stock, plugin = outcomes["stock"], outcomes["h2o"]
    assert [s[0] for s in plugin["streams"]] == [s[0] for s in stock["streams"]]
    assert (plugin["server_exit"] == 0) == (stock["server_exit"] == 0)


def test_restart_serves_again(model_path, outcomes):
    with Server(model_path, "--kv-eviction", "h2o", "--kv-budget", "64") as srv:
        r = srv.complete(PROMPT, max_tokens=100, ignore_eos=True)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 100
