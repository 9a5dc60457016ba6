"""`vllm serve MODEL [--kv-eviction P]` exactly as typed: vLLM sizes the KV cache.

Every other benchmark sizes the cache; a user who does not gets vLLM's own
sizing (on CPU, `--gpu-memory-utilization` of RAM less the worker's resident
memory after a warm-up: about 20 GiB of cache on a 24 GiB machine), and
whatever the plugin allocates beyond it is paid in swap-free RAM
(patches/worker_memory.py). Each configuration here is a fresh server with
nothing sized: N concurrent requests of a long prompt, the worker's resident
memory sampled throughout. Prints, per configuration: vLLM's figure and the
cache's share (from the server's log), the worker's memory requested and peak
resident, the machine's least available memory, tokens/s, and whether the
server survived.

    python benchmarks/default_sizing.py                       # stock, h2o, snapkv
    python benchmarks/default_sizing.py --configs "" "--kv-eviction h2o --kv-cache-dtype fp8 --kv-budget 256"
    python benchmarks/default_sizing.py --eager --model PATH   # a flag alone is read as the script's

Configurations run in the order given, reversed every other round (--rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from common import fmt, git_head, make_prompts

GIB = 2**30


def _worker(pid: int):
    import psutil

    for p in psutil.Process(pid).children(recursive=True):
        if "Worker" in p.name():
            return p
    return None


def _kill_tree(server: subprocess.Popen) -> None:
    """Stop the server (SIGTERM, then SIGKILL for whatever is left of it and
    the processes it started) and wait until they are gone: the next server's
    memory check must not see this one's cache."""
    import psutil

    try:
        procs = [psutil.Process(server.pid)] + psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    server.send_signal(signal.SIGTERM)  # a clean shutdown frees vLLM's shared memory
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=60)
    server.wait()


def _post(port: int, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=timeout))


def run_one(model: str, flags: str, prompts: list[list[int]], max_tokens: int, port: int,
            timeout: float) -> dict:
    import psutil

    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = ["vllm", "serve", model, "--port", str(port), *shlex.split(flags)]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    row = {"flags": flags or "(stock)", "survived": False}
    peak = {"rss": 0, "least_available": psutil.virtual_memory().available}
    stop = threading.Event()

    def sample():
        while not stop.wait(0.2):
            w = _worker(server.pid) if server.poll() is None else None
            try:
                if w is not None:
                    peak["rss"] = max(peak["rss"], w.memory_info().rss)
            except psutil.Error:
                pass
            peak["least_available"] = min(peak["least_available"],
                                          psutil.virtual_memory().available)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://localhost:{port}/health", timeout=2)
                break
            except Exception:
                if server.poll() is not None or time.time() - t0 > timeout:
                    raise RuntimeError("server did not start")
                time.sleep(2)
        row["startup_s"] = round(time.time() - t0)
        sampler.start()
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        t1 = time.time()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: _post(port, {**body, "prompt": p}, timeout), prompts))
        row["seconds"] = round(time.time() - t1, 1)
        row["tok_s"] = round(sum(o["usage"]["completion_tokens"] for o in outs) / row["seconds"], 2)
        row["survived"] = server.poll() is None
    except Exception as e:  # a dead engine answers 500, a dead server refuses
        row["error"] = f"{type(e).__name__}: {e}"[:120]
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        _kill_tree(server)
        text = open(log.name).read()
        os.unlink(log.name)
    if not row["survived"]:
        row["log"] = [line[-200:] for line in text.splitlines()
                      if "Error" in line or "error" in line][-3:] or text.splitlines()[-3:]
    m = re.search(r"Auto set \(([\d.]+)/[\d.]+\) GiB for KV cache.*?([\d.]+) GiB requested", text)
    if m:
        row["vllm_kv_gib"], row["requested_gib"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"of the ([\d.]+) GiB vLLM found for the KV cache, ([\d.]+) GiB stay", text)
    row["reserved_gib"] = float(m.group(2)) if m else 0.0
    row["peak_worker_gib"] = round(peak["rss"] / GIB, 2)
    row["least_available_gib"] = round(peak["least_available"] / GIB, 2)
    row["oom_killed"] = "Worker proc" in text and "died unexpectedly" in text
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--configs", nargs="+",
                    default=["", "--kv-eviction h2o", "--kv-eviction snapkv"],
                    help="flags after `vllm serve MODEL`, one string per server ('' = stock)")
    ap.add_argument("--eager", action="store_true",
                    help="add --enforce-eager to every server (starts in half the time)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=8137)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.model is None:
        from vllm_kvevict.models import ensure_smollm2

        args.model = ensure_smollm2()
    prompts = make_prompts(args.model, args.requests, args.prompt_tokens)
    rows = []
    for r in range(args.rounds):
        for flags in (args.configs if r % 2 == 0 else args.configs[::-1]):
            flags = f"{flags} --enforce-eager".strip() if args.eager else flags
            row = run_one(args.model, flags, prompts, args.max_tokens, args.port, args.timeout)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    cols = ["flags", "vllm_kv_gib", "reserved_gib", "requested_gib", "peak_worker_gib",
            "least_available_gib", "tok_s", "survived"]
    print(f"# vllm serve MODEL, vLLM's own KV sizing: {args.requests} x {args.prompt_tokens} "
          f"tokens, {args.max_tokens} out (commit {git_head()})")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(fmt(row.get(c)) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
