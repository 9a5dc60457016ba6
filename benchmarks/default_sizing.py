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
import re
import shlex
import sys
import threading
import time

from common import fmt, git_head, make_prompts, run_workload, typed_server

from vllm_kvevict.eval.server import Server

GIB = 2**30


def _watch(srv: Server, peak: dict, stop: threading.Event) -> None:
    """Until `stop`: the worker's largest resident memory and the machine's
    least available memory, every 0.2 s."""
    import psutil

    while not stop.wait(0.2):
        for p in srv.processes():
            try:
                if "Worker" in p.name():
                    peak["rss"] = max(peak["rss"], p.memory_info().rss)
            except psutil.Error:
                pass
        peak["least_available"] = min(peak["least_available"], psutil.virtual_memory().available)


def run_one(model: str, flags: str, prompts: list[list[int]], max_tokens: int,
            timeout: float) -> dict:
    import psutil

    srv = typed_server(model, shlex.split(flags), timeout=timeout)  # nothing sized
    row = {"flags": flags or "(stock)", "survived": False}
    peak = {"rss": 0, "least_available": psutil.virtual_memory().available}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(srv, peak, stop), daemon=True)
    procs = []
    try:
        t0 = time.time()
        srv.start()  # raises with the log's tail if the server exits or hangs
        row["startup_s"] = round(time.time() - t0)
        procs = srv.processes()
        watcher.start()
        run = run_workload(srv, prompts, max_tokens, timeout)
        row["seconds"], row["tok_s"] = round(run["wall_s"], 1), round(run["tok_s"], 2)
        row["survived"] = srv.proc.poll() is None
    except Exception as e:  # a dead engine answers 500, a dead server refuses
        row["error"] = f"{type(e).__name__}: {e}"[:120]
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        srv.stop()  # SIGINT first: a clean shutdown frees vLLM's shared memory
        # The next server's memory check must not see this one's cache.
        psutil.wait_procs(procs, timeout=60)
        text = srv.log()
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
            row = run_one(args.model, flags, prompts, args.max_tokens, args.timeout)
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
