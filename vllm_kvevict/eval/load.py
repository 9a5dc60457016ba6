"""Load on the OpenAI server: stock vLLM and the plugin, the same requests, one run.

For each server (stock: plugin not loaded; plugin: --kv-eviction h2o at
--budget), on loopback:
1. sends --requests streaming requests at once (completions and chat, mixed
   prompt and output lengths, seeded), with --cancel of them closed by the
   client after a few tokens;
2. reports output tok/s, p50/p99 time to first token and inter-token latency,
   and completed / cancelled / failed counts;
3. checks, once idle, that vLLM's own `vllm:kv_cache_usage_perc` and
   `vllm:num_requests_running` are back to 0 (no leaked block);
4. checks that no response contains another request's code word (every prompt
   carries a unique one: a cross-request KV mix would surface it), and re-sends
   --solo completed requests one at a time to count how many return the same
   text alone as under load. Batched vs alone can differ even in stock vLLM
   (bf16 numerics change with the batch), so both servers' counts are printed;
   the plugin fails only if it differs more often than stock by > 10 points.

Exit status 1 if a check fails.

    python -m vllm_kvevict.eval.load                 # ~10 min on 2 CPU cores
    python -m vllm_kvevict.eval.load --quick         # ~2 min
    python -m vllm_kvevict.eval.load --json load.json --plot load.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp

from vllm_kvevict.eval.server import Server  # the loopback `vllm serve` the tests use

TOPICS = ["a lighthouse keeper", "a CPU pipeline", "the tides", "a chess endgame",
          "bread baking", "a mountain railway", "honey bees", "a library at night"]


def make_requests(n: int, cancel_frac: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        code = f"{rng.choice('BCDFGHJKLMNPQRSTVWXZ')}{rng.randint(1000, 9999)}"
        text = (f"Reference code {code}. " + f"Notes about {rng.choice(TOPICS)}. " *
                rng.choice([1, 4, 16, 48]) + f"Write about {rng.choice(TOPICS)}.")
        reqs.append({"id": i, "code": code, "chat": i % 2 == 1, "prompt": text,
                     "max_tokens": rng.choice([16, 64, 128, 256]),
                     "cancel_after": rng.randint(2, 8) if rng.random() < cancel_frac else None})
    return reqs


def body(server: Server, req: dict, stream: bool) -> tuple[str, dict]:
    b = {"model": server.model, "max_tokens": req["max_tokens"], "temperature": 0,
         "ignore_eos": True, "stream": stream}
    if req.get("xargs"):  # per-request eviction settings (soak.py)
        b["vllm_xargs"] = req["xargs"]
    if req["chat"]:
        b["messages"] = [{"role": "user", "content": req["prompt"]}]
        return "/v1/chat/completions", b
    b["prompt"] = req["prompt"]
    return "/v1/completions", b


def chunk_text(event: dict, chat: bool) -> str:
    choice = event["choices"][0]
    return (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")


async def one(session: aiohttp.ClientSession, server: Server, req: dict) -> dict:
    path, b = body(server, req, stream=True)
    start = time.perf_counter()
    stamps, text = [], []
    try:
        async with session.post(server.url + path, json=b) as r:
            if r.status != 200:
                return {"id": req["id"], "status": "failed", "error": await r.text()}
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                piece = chunk_text(json.loads(line[5:]), req["chat"])
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
                if req["cancel_after"] and len(stamps) >= req["cancel_after"]:
                    return {"id": req["id"], "status": "cancelled", "tokens": len(stamps),
                            "stamps": [s - start for s in stamps]}
    except aiohttp.ClientError as e:  # where it broke tells a client race from a server fault
        return {"id": req["id"], "status": "failed",
                "error": f"{e!r} after {len(stamps)} tokens, {time.perf_counter() - start:.1f} s"}
    return {"id": req["id"], "status": "completed", "tokens": len(stamps),
            "stamps": [s - start for s in stamps], "text": "".join(text)}


def connector() -> aiohttp.TCPConnector:
    """Unlimited connections, each reused for at most 2 s after its last
    response. vLLM's server closes a connection idle for
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); aiohttp keeps one 15 s by default, so a
    request sent on a pooled connection just as the server closed it failed with
    ServerDisconnectedError (8 of 2,456 requests in a full soak; 0 of 2,450
    in the next run with this connector): a client race, not a server fault.
    Retiring connections before the server does removes it."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=2)


async def drive(server: Server, reqs: list[dict]) -> tuple[list[dict], float]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector()) as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(s, server, r) for r in reqs))
        return list(results), time.perf_counter() - t0


async def alone(server: Server, req: dict) -> str:
    path, b = body(server, req, stream=False)
    async with aiohttp.ClientSession() as s, s.post(server.url + path, json=b) as r:
        out = (await r.json())["choices"][0]
    return out["message"]["content"] if req["chat"] else out["text"]


def wait_idle(server: Server, timeout: float = 60.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        usage = server.metric("vllm:kv_cache_usage_perc")
        running = server.metric("vllm:num_requests_running")
        if (usage == 0 and running == 0) or time.monotonic() > deadline:
            return usage, running
        time.sleep(0.5)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_server(name: str, server_args: list[str], stock: bool, model: str,
               reqs: list[dict], solo: int, server_env: dict) -> dict:
    with Server(model, *server_args, stock=stock, env=server_env) as srv:
        return run_against(name, srv, reqs, solo)


def run_against(name: str, srv: Server, reqs: list[dict], solo: int) -> dict:
    """The load on a running server (one started for it, or one a test suite
    shares); `tokens_evicted` counts this run's evictions only."""
    evicted0 = srv.metric("vllm_kvevict_tokens_evicted_total")
    results, wall = asyncio.run(drive(srv, reqs))
    usage, running = wait_idle(srv)
    by_id = {r["id"]: r for r in reqs}
    done = [r for r in results if r["status"] == "completed"]
    codes = {r["code"] for r in reqs}
    mixed = [r["id"] for r in done
             if any(c in r["text"] and c != by_id[r["id"]]["code"] for c in codes)]
    sample = done[:solo]
    same = sum(asyncio.run(alone(srv, by_id[r["id"]])) == r["text"] for r in sample)
    evicted = srv.metric("vllm_kvevict_tokens_evicted_total") - evicted0
    ttft = [r["stamps"][0] for r in results if r.get("stamps")]
    itl = [b - a for r in results if r.get("stamps") for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r.get("tokens", 0) for r in results)
    return {"server": name, "requests": len(reqs), "completed": len(done),
            "cancelled": sum(r["status"] == "cancelled" for r in results),
            "failed": sum(r["status"] == "failed" for r in results),
            "errors": [r.get("error", "")[:200] for r in results if r["status"] == "failed"][:3],
            "wall_s": wall, "out_tok_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
            "kv_usage_idle": usage, "running_idle": running, "mixed": mixed,
            "solo_checked": len(sample), "solo_same": same, "tokens_evicted": evicted}


def table(rows: list[dict]) -> str:
    cols = [("server", "{}"), ("completed", "{}"), ("cancelled", "{}"), ("failed", "{}"),
            ("out_tok_s", "{:.1f}"), ("ttft_p50_s", "{:.2f}"), ("ttft_p99_s", "{:.2f}"),
            ("itl_p50_ms", "{:.0f}"), ("itl_p99_ms", "{:.0f}"), ("kv_usage_idle", "{:.3f}"),
            ("solo_same", "{}"), ("tokens_evicted", "{:.0f}")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f.format(r[c]) for c, f in cols]
        cells[-2] = f"{r['solo_same']}/{r['solo_checked']}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_failures(label: str, row: dict, usage_start: float = 0) -> list[str]:
    """What every load run must leave behind (the load and soak harnesses):
    the pool back to `usage_start` and nothing running once idle, no request
    holding another's code, no request failed."""
    bad = []
    if row["kv_usage_idle"] != usage_start or row["running_idle"] != 0:
        bad.append(f"{label}: pool not whole once idle (usage {row['kv_usage_idle']}, "
                   f"running+waiting {row['running_idle']})")
    if row["mixed"]:
        bad.append(f"{label}: requests {row['mixed']} contain another request's code")
    if row["failed"]:
        bad.append(f"{label}: {row['failed']} requests failed: {row['errors']}")
    return bad


def checks(rows: list[dict]) -> list[str]:
    """Each row's own checks (pool whole once idle, nothing mixed, nothing
    failed); given two or more rows, also the first (stock) against the last
    (the plugin): the plugin may match its solo output at most 10 points less
    often than stock. One row has nothing to compare with."""
    failures = [f for r in rows for f in run_failures(r["server"], r)]
    if len(rows) < 2:
        return failures
    stock, plugin = rows[0], rows[-1]
    rate = [r["solo_same"] / max(r["solo_checked"], 1) for r in (stock, plugin)]
    if rate[1] < rate[0] - 0.10:
        failures.append(f"plugin matches its solo output in {rate[1]:.0%} of requests, "
                        f"stock in {rate[0]:.0%}")
    return failures


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvevict.eval.load",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--cancel", type=float, default=0.1, help="fraction cancelled mid-stream")
    p.add_argument("--budget", type=int, default=128, help="--kv-budget of the plugin server")
    p.add_argument("--solo", type=int, default=24, help="completed requests re-sent alone")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="64 requests, 8 solo re-sends")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    if args.quick:
        args.requests, args.solo = 64, 8
    from vllm_kvevict.models import ensure_smollm2

    model = args.model or ensure_smollm2()
    reqs = make_requests(args.requests, args.cancel, args.seed)
    common = ["--dtype", args.dtype, "--kv-cache-memory-bytes", str(256 << 20),
              "--max-num-seqs", "256"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "1"}  # the model on core 1, this client on core 0
    rows = [run_server("stock", common, True, model, reqs, args.solo, env),
            run_server(f"h2o@{args.budget}", [*common, "--kv-eviction", "h2o", "--kv-budget",
                                              str(args.budget)], False, model, reqs,
                       args.solo, env)]
    print(f"{args.requests} streaming requests at once ({args.cancel:.0%} cancelled), "
          f"{model}, {args.dtype}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        for ax, key in zip(axes, ("out_tok_s", "ttft_p99_s", "itl_p99_ms")):
            ax.bar([r["server"] for r in rows], [r[key] for r in rows])
            ax.set_title(key)
        fig.tight_layout()
        fig.savefig(args.plot)
    failures = checks(rows)
    for f in failures:
        print("CHECK FAILED:", f)
    print("checks:", "FAILED" if failures else "pool whole, no mixing, solo match within stock's")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
