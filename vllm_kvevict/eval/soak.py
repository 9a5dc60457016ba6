"""Soak: thousands of requests against real servers, one policy's server after another.

Each phase starts a `vllm serve` on loopback (or uses a running one), with a
pool short enough that vLLM preempts, and sends streaming requests in waves
(completions and chat, mixed lengths, seeded) of which:
- a share ask for their own, smaller `kv_budget` through `vllm_xargs`;
- 10-20% are cancelled by the client after a few tokens;
- in the `modules` phase, half are PML prompts over a registered schema while a
  second schema is registered, used and removed over and over beside them.

After each phase, read from vLLM's own accounting and the server's processes:
`vllm:kv_cache_usage_perc` and running/waiting requests back to 0 (every block
back in the BlockPool), no response carrying another request's code word, no
failed request, and the same EngineCore process as at the start (no restart).

    python -m vllm_kvevict.eval.soak                      # 2,400 requests, every phase
    python -m vllm_kvevict.eval.soak --requests 40 --phases h2o,modules
    python -m vllm_kvevict.eval.soak --json soak.json

Exit status 1 if a check fails. `tests/test_soak.py` runs a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp
import requests

from vllm_kvevict.eval import load
from vllm_kvevict.eval.server import Server, kv_pool_bytes
from vllm_kvevict.models import native_dtype

BLOCK = 32  # DEFAULT_ARGS' --block-size: the smallest per-request budget
# Pool short: a quarter of the tests' pool, about 1,000 SmolLM2 tokens, for up to
# 48 running requests of up to ~300 prompt tokens, so vLLM preempts. Chunks of
# 256 prompt tokens keep a request's peak (budget + chunk) inside it.
SHORT_POOL = ("--kv-cache-memory-bytes", str(kv_pool_bytes(native_dtype()) // 4),
              "--max-num-batched-tokens", "256",
              "--max-num-seqs", "48")
MODULES_ENV = {"VLLM_PLUGINS": "kvevict,kvevict_modules"}  # endpoint plugins are opt-in
PHASES = {  # name -> (server arguments, env)
    "h2o": (("--kv-eviction", "h2o", "--kv-budget", "128", *SHORT_POOL), None),
    "snapkv": (("--kv-eviction", "snapkv", "--kv-budget", "128", *SHORT_POOL), None),
    "andpro": (("--kv-eviction", "andpro", "--kv-budget", "128", *SHORT_POOL), None),
    "streaming": (("--kv-eviction", "streaming", "--kv-budget", "128", *SHORT_POOL), None),
    "modules": (("--kv-eviction", "snapkv", "--kv-budget", "128", *SHORT_POOL), MODULES_ENV),
    # Offload keeps prompts whole (a request may hold max_model_len), so the
    # default pool; what it drops goes to a 256 MiB host pool.
    "offload": (("--kv-eviction", "infinigen", "--kv-swap-space", "256MiB",
                 "--max-num-seqs", "48"), None),
}
DOC = ("The {t} notes describe {t} in detail, with dates, names and numbers that a "
       "reader may ask about later. ")
SCHEMA = "<schema name=\"{name}\">Answer from the notes.\n{modules}\n</schema>"


def schema_pml(name: str, topics: list[str]) -> str:
    mods = "\n".join(f'<module name="m{i}">{DOC.format(t=t) * 3}</module>'
                     for i, t in enumerate(topics))
    return SCHEMA.format(name=name, modules=mods)


def make_requests(n: int, budget: int, cancel: float, seed: int,
                  schema: tuple[str, int] | None = None) -> list[dict]:
    """load.make_requests, shorter outputs, plus per-request budgets (a third of them, one block to
    the server's `budget`) and, with `schema` (name, modules), PML prompts for
    every other request: some of its modules in random order, then the text."""
    rng = random.Random(seed + 1)
    reqs = load.make_requests(n, cancel, seed)
    for r in reqs:
        r["max_tokens"] = rng.choice([8, 16, 32, 96])  # many short requests: churn, not decode
        if rng.random() < 1 / 3:
            r["xargs"] = {"kv_budget": rng.randrange(BLOCK, budget + 1, BLOCK)}
        if schema and r["id"] % 2 == 0:
            name, count = schema
            mods = "".join(f"<m{i}/>" for i in rng.sample(range(count), rng.randint(1, count)))
            r["prompt"] = f'<prompt schema="{name}">{mods}{r["prompt"]}</prompt>'
            r["chat"] = False
    return reqs


async def churn_schemas(srv: Server, stop: asyncio.Event, seed: int) -> dict:
    """Register a schema, send two PML prompts over it, remove it; again until
    `stop`. Returns counts; any non-200 is recorded as an error."""
    out = {"registered": 0, "removed": 0, "requests": 0, "errors": []}
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=load.connector()) as s:
        i = 0
        while not stop.is_set():
            name = f"churn{i}"
            pml = schema_pml(name, rng.sample(load.TOPICS, 2))
            async with s.post(srv.url + "/v1/kvevict/schemas", json={"pml": pml}) as r:
                if r.status != 200:
                    out["errors"].append(f"register {name}: {r.status} {await r.text()}")
                    return out
            out["registered"] += 1
            for j in range(2):
                body = {"model": srv.model, "max_tokens": 8, "temperature": 0,
                        "prompt": f'<prompt schema="{name}"><m{j}/>Summarise.</prompt>'}
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    out["requests"] += 1
                    if r.status != 200:
                        out["errors"].append(f"{name} prompt: {r.status} {await r.text()}")
            async with s.delete(srv.url + f"/v1/kvevict/schemas/{name}") as r:
                if r.status != 200:
                    out["errors"].append(f"remove {name}: {r.status} {await r.text()}")
            out["removed"] += 1
            i += 1
    return out


async def drive(srv: Server, reqs: list[dict], wave: int, churn_seed: int | None):
    """`reqs` in waves of `wave` concurrent streams (and, with `churn_seed`,
    the schema churn beside them). Returns (results, churn counts, wall s)."""
    stop = asyncio.Event()
    churn = (asyncio.create_task(churn_schemas(srv, stop, churn_seed))
             if churn_seed is not None else None)
    timeout = aiohttp.ClientTimeout(total=1800)
    results = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=load.connector()) as s:
        for k in range(0, len(reqs), wave):
            results += await asyncio.gather(*(load.one(s, srv, r) for r in reqs[k:k + wave]))
    stop.set()
    counts = await churn if churn else None
    return results, counts, time.perf_counter() - t0


def total(scrape: dict[str, float], name: str) -> float:
    """Sum of a metric's samples over its labels, in one `/metrics` scrape."""
    return sum(v for k, v in scrape.items() if k.split("{")[0] == name)


def wait_idle(srv: Server, usage: float, timeout: float = 60.0) -> dict[str, float]:
    """Scrape `/metrics` until nothing runs or waits and KV usage is back to
    `usage` (what pinned module blocks hold), or `timeout`; the last scrape.
    vLLM reports usage once per engine step, and removing a schema frees
    blocks without one: a one-token request first makes the engine step (its
    own blocks are freed before that step's report)."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        busy = total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    srv.complete("Hello", max_tokens=1).raise_for_status()
    while True:
        m = srv.metrics()
        busy = total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")
        if (busy == 0 and total(m, "vllm:kv_cache_usage_perc") == usage
                or time.monotonic() > deadline):
            return m
        time.sleep(0.5)


def engine_cores(srv: Server) -> list[int]:
    return sorted(p.pid for p in srv.processes() if p.name().startswith("VLLM::EngineCore"))


def run_phase(name: str, srv: Server, reqs: list[dict], wave: int = 48,
              churn_seed: int | None = None) -> dict:
    """One phase on a running server; the checks' inputs in a dict (see `checks`)."""
    cores = engine_cores(srv)
    pinned = total(wait_idle(srv, 0.0, timeout=0), "vllm:kv_cache_usage_perc")  # module blocks
    before = {k: srv.metric(k) for k in ("vllm:num_preemptions_total", "vllm_kvevict_tokens_evicted_total")}
    results, churn, wall = asyncio.run(drive(srv, reqs, wave, churn_seed))
    idle = wait_idle(srv, pinned)
    by_id = {r["id"]: r for r in reqs}
    codes = {r["code"] for r in reqs}
    done = [r for r in results if r["status"] == "completed"]
    failed = [r for r in results if r["status"] == "failed"]

    return {"phase": name, "requests": len(reqs) + (churn["requests"] if churn else 0),
            "completed": len(done), "cancelled": sum(r["status"] == "cancelled" for r in results),
            "failed": len(failed), "errors": [r["error"][:200] for r in failed][:3],
            "own_budget": sum("xargs" in r for r in reqs),
            "pml": sum(r["prompt"].startswith("<prompt") for r in reqs),
            "churn": churn, "wall_s": round(wall, 1),
            "out_tok_s": round(sum(r.get("tokens", 0) for r in results) / wall, 1),
            "preemptions": total(idle, "vllm:num_preemptions_total") - before["vllm:num_preemptions_total"],
            "tokens_evicted": (total(idle, "vllm_kvevict_tokens_evicted_total")
                               - before["vllm_kvevict_tokens_evicted_total"]),
            "kv_usage_idle": total(idle, "vllm:kv_cache_usage_perc"), "kv_usage_start": pinned,
            "running_idle": total(idle, "vllm:num_requests_running") + total(idle, "vllm:num_requests_waiting"),
            "mixed": [r["id"] for r in done
                      if any(c in r["text"] and c != by_id[r["id"]]["code"] for c in codes)],
            # vLLM logs an ERROR in every process when the repository's own
            # triton_kernels/ (on sys.path from the checkout) shadows OpenAI's
            # triton_kernels package it probes for MoE: not a serving error.
            "server_errors": [line[:300] for line in srv.log().splitlines()
                              if (" ERROR " in line or line.startswith("Traceback"))
                              and "triton_kernels.matmul" not in line][:5],
            "engine_restarted": engine_cores(srv) != cores or not cores,
            "healthy": srv.healthy()}


def checks(row: dict) -> list[str]:
    """What must hold after every phase; an empty list when it does."""
    p = row["phase"]
    bad = load.run_failures(p, row, row["kv_usage_start"])
    if row["churn"] and row["churn"]["errors"]:
        bad.append(f"{p}: schema churn: {row['churn']['errors'][:3]}")
    if "schema_removed" in row and (row["schema_removed"] != 200
                                    or row["kv_usage_after_removal"] != 0):
        bad.append(f"{p}: schema removal {row['schema_removed']}, KV usage after it "
                   f"{row['kv_usage_after_removal']}")
    if row["engine_restarted"] or not row["healthy"]:
        bad.append(f"{p}: engine core restarted or server unhealthy")
    return bad


def soak_phase(name: str, model: str, n: int, seed: int, wave: int) -> dict:
    """Start the phase's server, (modules: register the schema,) run, stop."""
    args, env = PHASES[name]
    if name == "offload":  # its server needs the model's skewing file: made once, offline
        from vllm_kvevict.calibrate import calibrate

        calibrate(model)
    with Server(model, *args, env=env) as srv:
        schema = register_schema(srv, "soak", 4) if name == "modules" else None
        reqs = make_requests(n, 128, cancel=0.15, seed=seed, schema=schema)
        row = run_phase(name, srv, reqs, wave, churn_seed=seed if schema else None)
        if schema:
            remove_schema(srv, row, "soak")
        return row


def register_schema(srv: Server, name: str, modules: int) -> tuple[str, int]:
    pml = schema_pml(name, load.TOPICS[:modules])
    r = requests.post(srv.url + "/v1/kvevict/schemas", json={"pml": pml}, timeout=300)
    r.raise_for_status()
    return name, modules


def remove_schema(srv: Server, row: dict, name: str) -> None:
    """Remove the phase's schema; with nothing running, vLLM's pool must then be
    empty: module blocks were the only ones left (checked by `checks`)."""
    status = requests.delete(srv.url + f"/v1/kvevict/schemas/{name}", timeout=60).status_code
    row["schema_removed"] = status
    row["kv_usage_after_removal"] = total(wait_idle(srv, 0.0), "vllm:kv_cache_usage_perc")


COLS = ["phase", "requests", "completed", "cancelled", "failed", "own_budget", "pml",
        "preemptions", "tokens_evicted", "out_tok_s", "wall_s", "kv_usage_idle"]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLS) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--phases", default=",".join(PHASES), help=f"of {','.join(PHASES)}")
    p.add_argument("--requests", type=int, default=400, help="per phase")
    p.add_argument("--wave", type=int, default=48, help="concurrent streams")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    from vllm_kvevict.models import ensure_smollm2

    model = args.model or ensure_smollm2()
    rows, failures = [], []
    for i, name in enumerate(args.phases.split(",")):
        row = soak_phase(name, model, args.requests, args.seed + i, args.wave)
        rows.append(row)
        failures += checks(row)
        print(f"{name}: {json.dumps({k: row[k] for k in COLS[1:]})}", flush=True)
    print(table(rows))
    print(f"total requests: {sum(r['requests'] for r in rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    for f in failures:
        print("CHECK FAILED:", f)
    print("checks:", "FAILED" if failures else "pool whole after every phase, no mixing, "
          "no failure, no engine restart")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
