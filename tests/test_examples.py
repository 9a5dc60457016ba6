"""The examples in examples/ run as a user runs them and do what they say.

Each runs as a child process, the shell scripts with this venv's bin first on
PATH (they call `python` and `vllm`, as in an activated venv) and a free port
(PORT), on this xdist worker's cores (conftest's OMP_NUM_THREADS and
VLLM_CPU_OMP_THREADS_BIND are inherited) and with the engine core in its own
process, as outside the suite. What each must print:

  offline_h2o.py             two answers, then the plugin's counters: the engine
                             compacted and evicted tokens
  prompt_modules.py          both PML chats reuse module tokens (vLLM's own
                             num_cached_tokens > 0), the modules are pinned, and
                             removing the schema releases blocks
  metrics_scrape.py          the eviction series, with tokens evicted > 0
  serve_h2o.sh               a chat completion with text
  serve_prompt_modules.sh    the schema registered, both PML requests answered
                             with cached prompt tokens, the schema listed and
                             removed
  either serve script        given a model path that does not exist: an error
                             exit, not a wait for /health forever

Not run here: examples/serve_ray_tp.sh (a Ray head and a TP 2 server on two
cores, minutes; its last run is in docs/serving.md). What it serves is
checked by tests/test_ray.py (TP 2 over Ray, offline) and
tests/test_pipeline_serve.py (`vllm serve` over Ray at PP 2).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from vllm_kvevict.eval.server import free_port, session_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 900  # a server's cold start on a busy 2-core machine took over 300 s once


def run_example(argv: list[str], timeout: float = TIMEOUT_S, **env) -> str:
    """Run one example to its end in its own session; its stdout. It must exit 0."""
    rc, out, err = run_to_end(argv, timeout, **env)
    assert rc == 0, f"{argv} exited {rc}:\n{out[-3000:]}\n{err[-5000:]}"
    return out


def run_to_end(argv: list[str], timeout: float, **env) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv` run in its own session, as a
    user runs it; whatever the session left running is stopped after."""
    e = dict(os.environ, **env)
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the suite's in-process engine core
    e.pop("KVEVICT_METRICS_DIR", None)
    proc = subprocess.Popen(argv, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _stop_session(proc.pid)
    return proc.returncode, out, err


def _stop_session(sid: int, grace_s: float = 30.0) -> None:
    """SIGTERM every process of session `sid` (a server the script's trap
    signalled may still be shutting down), SIGKILL what is left after grace_s."""
    deadline = time.monotonic() + grace_s
    sent = False
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        if not sent:
            for p in left:
                p.send_signal(signal.SIGTERM)
            sent = True
        time.sleep(0.5)
    for p in session_processes(sid):
        p.kill()


def json_lines(out: str) -> list:
    """Every stdout line that is a JSON document, parsed (curl's answers)."""
    docs = []
    for line in out.splitlines():
        try:
            docs.append(json.loads(line))
        except ValueError:
            pass
    return docs


def counter(out: str, name: str) -> float:
    """The value of Prometheus series `name` (no labels) in the printed
    exposition; a missing series fails the test."""
    m = re.search(rf"^{name} (\S+)$", out, re.M)
    assert m, f"{name} not printed:\n{out[-2000:]}"
    return float(m.group(1))


def test_offline_h2o_example_answers_and_compacts(model_path):
    out = run_example([sys.executable, "examples/offline_h2o.py", model_path])
    answers = [a.strip() for a in out.split("\n---")[:-1]]
    assert len(answers) == 2 and all(len(a) > 100 for a in answers), out[-2000:]
    assert counter(out, "vllm_kvevict_compactions_total") > 0, out[-2000:]
    assert counter(out, "vllm_kvevict_tokens_evicted_total") > 0, out[-2000:]


def test_prompt_modules_example_reuses_module_tokens(model_path):
    out = run_example([sys.executable, "examples/prompt_modules.py", model_path])
    reused = re.findall(r"^(\d+) of (\d+) prompt tokens reused: (.+)$", out, re.M)
    assert len(reused) == 2, out[-2000:]
    assert all(0 < int(n) < int(total) and len(text) > 2 for n, total, text in reused), reused
    pinned = re.search(r"^pinned: (.+)$", out, re.M)
    assert pinned and "alice" in pinned.group(1) and "bob" in pinned.group(1), out[-2000:]
    released = re.search(r"^blocks released: (\d+)$", out, re.M)
    assert released and int(released.group(1)) > 0, out[-2000:]


def test_metrics_scrape_example_shows_tokens_evicted(model_path):
    out = run_example([sys.executable, "examples/metrics_scrape.py", model_path])
    assert counter(out, "vllm_kvevict_tokens_evicted_total") > 0, out[-2000:]


def test_serve_h2o_example_answers_a_chat(model_path):
    out = run_example(["bash", "examples/serve_h2o.sh", model_path], PORT=str(free_port()))
    chats = [d for d in json_lines(out) if d.get("object") == "chat.completion"]
    assert len(chats) == 1, out[-2000:]
    assert len(chats[0]["choices"][0]["message"]["content"]) > 100, chats


@pytest.mark.parametrize("script", ["serve_h2o.sh", "serve_prompt_modules.sh"])
def test_a_serve_example_stops_when_its_server_cannot_start(tmp_path, script):
    """A server that dies at startup (here: no model at that path) ends the
    script with an error, where it once waited for /health forever."""
    rc, out, err = run_to_end(["bash", f"examples/{script}", str(tmp_path / "no-model")],
                              timeout=300, PORT=str(free_port()))
    assert rc != 0 and "no-model" in out + err, (rc, out[-2000:], err[-2000:])


def test_serve_prompt_modules_example_registers_reuses_and_removes(model_path):
    out = run_example(["bash", "examples/serve_prompt_modules.sh", model_path],
                      PORT=str(free_port()))
    docs = json_lines(out)
    answers = [d for d in docs if d.get("object") in ("text_completion", "chat.completion")]
    assert len(answers) == 2, out[-3000:]
    for a in answers:
        cached = (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert cached > 0, a  # the modules' blocks were reused, by vLLM's own count
    assert len(docs) == 5, out[-3000:]  # + registered, listed, removed
    registered, listed, removed = docs[0], docs[3], docs[4]
    assert registered["name"] == "city" and [s["name"] for s in listed["schemas"]] == ["city"]
    assert removed["name"] == "city" and removed["blocks_released"] > 0, removed
