"""Per-decode-step cost of KV eviction vs batch size and context length.

How much does the plugin add to every decode step, and how does that grow with
the work? For each (batch, ctx) point, stock vLLM and the plugin (h2o by
default; --policies adds others) run the same requests in the same run, and
the table reports ms per decode step for both, the difference, and where the
plugin's time goes.

Method
------
* Engines. One engine per (policy, ctx), each in its own subprocess, reused
  for every batch size at that ctx. Not one engine per policy: the plugin's
  budget is an engine setting (additional_config) and must equal ctx here.
  "stock" is vLLM with no general plugin loaded at all (VLLM_PLUGINS=""), so
  the baseline is what a user gets without installing vllm_kvevict. All
  engines: SmolLM2-135M-Instruct (the embedded default model), bfloat16,
  enforce_eager, block size 32, max_model_len 8192, prefix caching off (both
  do the same prefill), KV pool sized explicitly for the largest batch at that
  ctx (no preemption), max_num_batched_tokens = largest batch * ctx so that
  the whole batch is prefilled in ONE step and every request then decodes in
  lockstep (with chunked prefill, the first requests would decode, and finish,
  while later ones are still prefilling).
* Interleaving. The engines of one ctx are alive at the same time, each in
  its own process, and every point runs on all of them with their steps
  interleaved: the parent sends "step" to each engine in turns of
  STEPS_PER_TURN steps in a fixed cycle (benchmarks/interleave.py: a turn's
  first step follows another engine's, the rest the engine's own, the same
  mix for every engine), and only engine.step() itself is timed. On this
  project's shared VMs the same matrix product's speed flips between two
  levels 1.7x apart within seconds (a noisy neighbour on the core's sibling);
  running whole points back to back put one side on the fast level and the
  other on the slow one often enough to move a point's overhead by +/- 30%.
  Adjacent steps see the same level.
* A point. `batch` requests, prompts of exactly `ctx` token ids sliced from a
  real-text corpus at distinct offsets (benchmarks/common.make_prompts),
  max_tokens = --decode (default 96 = 3 blocks), ignore_eos, greedy. The
  engine is driven step by step (LLMEngine.step) and every step is timed.
  Only steps whose SchedulerOutput schedules exactly one token for each of the
  `batch` requests count as decode steps (no prefill, nobody finished).
* Repeats (--repeats N): every point runs N times (each run interleaved
  as above), and the table reports the run whose overhead is the median of
  the N, with every run's overhead beside it.
* Statistic: the MEAN decode-step time, not the median. The plugin's work is
  periodic: H2O scores decode queries in batches of up to 16 steps (decode
  log flush) and, with all requests in lockstep, every request compacts in the
  same step once per block (32 steps). A median picks a step with neither and
  hides most of the overhead; the mean amortises it, as throughput sees it.
  Medians are reported beside it (their difference is roughly the per-step
  hooks alone).
* Budget = ctx, so the plugin never evicts prompt tokens before decode starts
  and attends over about as many tokens as stock: stock grows from ctx to
  ctx + decode, the plugin compacts back to ctx whenever it reaches
  ctx + 32. The "resident" column gives the mean tokens attended per request
  over the decode steps for both (from vLLM's num_computed_tokens minus the
  plugin's evicted counts): the plugin attends over (decode - 32) / 2 fewer
  tokens on average, a small bias in its favour (under 5% of the attention
  work for ctx >= 1024). Compactions are the scheduler-side manager's own
  num_compactions counter (expect about 2 per request with decode 96).
* Breakdown (plugin rows): timers wrapped around plugin functions from this
  script only (no plugin file is edited; the list is common.PER_STEP), nested
  timers count exclusive time, summed over the decode steps and divided by
  their number:
    scoring     backend.score_step (per layer: store the step's queries, zero
                new slots), DecodeQueryLog.flush (batched H2O scoring of the
                logged queries, wherever called), WorkerEviction._compaction_scores
    compaction  WorkerEviction._compact (select + gather/scatter of KV and
                scores)
    bookkeeping WorkerEviction.begin_step / place_queries, backend.
                physical_metadata, EvictableAttentionManager.remove_skipped_blocks
  "other" = overhead - (scoring + compaction + bookkeeping): what the timers
  do not see (e.g. the backend writing KV itself, the wrappers' own cost of a
  few microseconds per call, noise).
* Not counted: prefill steps. Under h2o, prefill also scores the prompt in
  plain torch (quadratic in ctx), which is slow on CPU; its wall time is in
  the JSON ("prefill_s") but not in the table.

Grid: batch {1, 8, 32, 128} x ctx {256, 1024, 4096, 8000}, skipping points
whose prompt tokens batch * ctx exceed --kv-cap (default 64K tokens: the
prefill of the larger points costs minutes each on one core; pass
--kv-cap 131072 to add 32x4096 and 128x1024). Skipped points are printed.

Command (full default grid, one core; see results/scaling/scaling.md for its time):
    VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 .venv/bin/python benchmarks/scaling.py \\
        --json results/scaling/scaling.json --plot results/scaling/scaling.png \\
        --md results/scaling/scaling.md
Smoke test (a few minutes):
    VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 .venv/bin/python benchmarks/scaling.py --quick
"""

from __future__ import annotations

import os

# In-process engine core: the scheduler and the worker state are readable here.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (
    CATEGORIES,
    RESULT_MARKER,
    Timers,
    fmt,
    git_head,
    install_timers,
    kv_bytes_per_token,
    make_prompts,
    plugin_fingerprint,
)
from interleave import take_turns

from vllm_kvevict.core.config.settings import POLICIES
from vllm_kvevict.probe import full_attention_manager, scheduler_of

READY_MARKER = "@@KVEVICT_READY@@ "
BLOCK_SIZE = 32
MAX_MODEL_LEN = 8192


# --------------------------------------------------------------------------- grid


def grid(batches, contexts, decode: int, kv_cap: int):
    """(points, skipped): points are (batch, ctx); skipped are (batch, ctx, why)."""
    points, skipped = [], []
    for ctx in contexts:
        for b in batches:
            if ctx + decode > MAX_MODEL_LEN:
                skipped.append((b, ctx, f"ctx + decode > max_model_len {MAX_MODEL_LEN}"))
            elif b * ctx > kv_cap:
                skipped.append((b, ctx, f"batch*ctx = {b * ctx} > --kv-cap {kv_cap}"))
            else:
                points.append((b, ctx))
    return points, skipped


def engine_config(policy: str, ctx: int, max_batch: int, args) -> dict:
    """One engine's settings: pool for max_batch requests of ctx + decode tokens."""
    blocks_per_req = math.ceil((ctx + args.decode) / BLOCK_SIZE)
    # The warm-up (max_batch x 56 tokens) fits too; vLLM wants room for one
    # max_model_len request; + 1 null block + 2 spare.
    blocks = max(max_batch * max(blocks_per_req, 2), MAX_MODEL_LEN // BLOCK_SIZE) + 3
    return dict(policy=policy, ctx=ctx, max_batch=max_batch, model=args.model,
                dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, decode=args.decode,
                pool_blocks=blocks,
                max_num_batched_tokens=max(max_batch * ctx, MAX_MODEL_LEN))


# --------------------------------------------------------------------------- worker side


class StepLog:
    """Wraps this engine's scheduler.schedule: keeps the last SchedulerOutput
    and the resident (physical) tokens of each running request at that step."""

    def __init__(self, llm) -> None:
        self.sched = scheduler_of(llm)
        self.manager = full_attention_manager(self.sched)
        self.out = None
        self.resident: list[int] = []
        schedule = self.sched.schedule

        def logged(*args, **kwargs):
            self.out = schedule(*args, **kwargs)
            evicted = getattr(self.manager, "evicted", {})
            # num_computed_tokens already counts the tokens scheduled now
            self.resident = [r.num_computed_tokens - evicted.get(r.request_id, 0)
                             for r in self.sched.running]
            return self.out

        self.sched.schedule = logged

    def is_decode(self, batch: int) -> bool:
        """Exactly one token for each of `batch` requests: pure decode, all running."""
        out = self.out
        return (out is not None and len(out.num_scheduled_tokens) == batch
                and out.total_num_scheduled_tokens == batch)

    def counters(self) -> tuple[int, int]:
        m = self.manager
        return getattr(m, "num_compactions", 0), getattr(m, "num_tokens_evicted", 0)


def build_engine(cfg: dict):
    from vllm import LLM

    additional = {}
    if cfg["policy"] != "none":
        additional = {"kv_eviction": cfg["policy"], "kv_budget": cfg["ctx"]}
    kv_dtype = cfg.get("kv_cache_dtype", "auto")
    bpt = kv_bytes_per_token(cfg["model"], cfg["dtype"], kv_dtype)
    return LLM(cfg["model"], enforce_eager=True, dtype=cfg["dtype"], block_size=BLOCK_SIZE,
               kv_cache_dtype=kv_dtype,
               max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, seed=0,
               max_num_seqs=cfg["max_batch"],
               max_num_batched_tokens=cfg["max_num_batched_tokens"],
               kv_cache_memory_bytes=cfg["pool_blocks"] * BLOCK_SIZE * bpt,
               additional_config=additional)


def submit(llm, prompts, decode: int, tag: str) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=decode, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(prompts):
        llm.llm_engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)


def timed_step(llm, log: StepLog, timers: Timers | None, batch: int) -> tuple:
    """One engine step: (seconds, is_decode, resident tokens per request,
    {category: seconds}, CPU seconds)."""
    if timers:
        timers.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    llm.llm_engine.step()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (dt, log.is_decode(batch), log.resident,
            dict(timers.seconds) if timers else {}, cpu)


class PointRun:
    """One point on this engine, driven one step at a time so that the parent
    can interleave the engines' steps (see "Interleaving" above)."""

    def __init__(self, llm, log: StepLog, timers: Timers | None, cfg: dict, batch: int) -> None:
        self.llm, self.log, self.timers, self.cfg, self.batch = llm, log, timers, cfg, batch
        self.counters0 = log.counters()
        self.steps: list[tuple] = []
        self.t0 = time.perf_counter()
        submit(llm, make_prompts(cfg["model"], batch, cfg["ctx"]), cfg["decode"],
               f"b{batch}c{cfg['ctx']}")

    def step(self) -> bool:
        """Run one step if any is left; True while steps remain."""
        if self.llm.llm_engine.has_unfinished_requests():
            self.steps.append(timed_step(self.llm, self.log, self.timers, self.batch))
        return self.llm.llm_engine.has_unfinished_requests()

    def result(self) -> dict:
        """Stats over the decode steps of the point."""
        steps, timers, cfg = self.steps, self.timers, self.cfg
        wall = time.perf_counter() - self.t0
        (comp0, ev0), (comp1, ev1) = self.counters0, self.log.counters()
        dec = [s for s in steps if s[1]]
        ms = [1000 * s[0] for s in dec]  # per decode step, ms
        breakdown = {c: 1000 * sum(s[3].get(c, 0.0) for s in dec) / max(1, len(dec))
                     for c in CATEGORIES} if timers else {}
        return {
            "ok": True, "policy": cfg["policy"], "batch": self.batch, "ctx": cfg["ctx"],
            "decode": cfg["decode"], "budget": cfg["ctx"] if cfg["policy"] != "none" else None,
            "decode_steps": len(dec), "steps": len(steps), "wall_s": wall,
            "prefill_s": sum(s[0] for s in steps if not s[1]),
            # this process's CPU time (engine and worker run in it): what another
            # process on the machine cannot inflate, unlike wall time
            "prefill_cpu_s": sum(s[4] for s in steps if not s[1]),
            "mean_cpu_ms": statistics.fmean(1000 * s[4] for s in dec) if dec else None,
            "mean_ms": statistics.fmean(ms) if ms else None,
            "median_ms": statistics.median(ms) if ms else None,
            "min_ms": min(ms, default=None), "max_ms": max(ms, default=None),
            "step_ms": ms,
            # mean over decode steps of the mean resident tokens per request
            "resident": statistics.fmean(statistics.fmean(s[2]) for s in dec) if dec else None,
            "compactions": comp1 - comp0, "tokens_evicted": ev1 - ev0,
            "breakdown_ms": breakdown,
            "loadavg": os.getloadavg()[0],
        }


def warm_up(llm, log: StepLog, cfg: dict) -> None:
    """Untimed: lazy initialisation and first-step allocations of the engine,
    with the largest batch of this engine, before any measured point."""
    submit(llm, make_prompts(cfg["model"], cfg["max_batch"], 48, seed_offset=5), 8, "warm")
    while llm.llm_engine.has_unfinished_requests():
        timed_step(llm, log, None, cfg["max_batch"])


def scoring_path() -> str:
    """Where this engine scores (the compiled CPU kernel's path, or torch and why)."""
    from vllm_kvevict.core.eviction.kernel_dispatch import cpu_path

    return cpu_path()


def worker_main(cfg: dict) -> None:
    """Child: build the engine, then serve points read as JSON lines on stdin."""
    t0 = time.perf_counter()
    llm = build_engine(cfg)
    log = StepLog(llm)
    warm_up(llm, log, cfg)
    timers = install_timers() if cfg["policy"] != "none" else None
    info = {"init_s": time.perf_counter() - t0, "manager": type(log.manager).__name__,
            "num_gpu_blocks": log.sched.kv_cache_manager.block_pool.num_gpu_blocks,
            "plugin_sha1": plugin_fingerprint(), "git_head": git_head(),
            "scoring_path": scoring_path()}
    _emit(READY_MARKER, info)
    run = None
    for line in sys.stdin:  # {"start": batch}, then {"step": 1} until done, then {"result": 1}
        cmd = json.loads(line)
        try:
            if "start" in cmd:
                run = PointRun(llm, log, timers, cfg, cmd["start"])
                res = {"ok": True}
            elif "step" in cmd:
                res = {"ok": True, "more": run.step()}
            else:
                res = {**run.result(), **info}
        except Exception as exc:  # report, keep serving
            import traceback

            traceback.print_exc()
            res = {"ok": False, "error": repr(exc)[:300]}
        _emit(RESULT_MARKER, res)
    llm.llm_engine.engine_core.shutdown()


def _emit(marker: str, obj: dict) -> None:
    sys.stdout.write(marker + json.dumps(obj) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- parent side


class Worker:
    """A child process holding one engine; `call` runs one point on it."""

    def __init__(self, cfg: dict, verbose: bool) -> None:
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1")
        if cfg["policy"] == "none":
            env["VLLM_PLUGINS"] = ""  # stock vLLM: no general plugin loaded
        if not verbose:
            env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.cfg, self.verbose, self.tail = cfg, verbose, []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env)
        self.info, self.error = None, "engine not running"

    def read(self, marker: str) -> dict | None:
        """Lines until `marker`; None if the child exits first."""
        for line in self.proc.stdout:
            if line.startswith(marker):
                return json.loads(line[len(marker):])
            self.tail = (self.tail + [line])[-100:]
            if self.verbose:
                sys.stderr.write(line)
        return None

    def ready(self) -> bool:
        self.info = self.read(READY_MARKER)
        if self.info is None:
            sys.stderr.write("".join(self.tail))
            errors = [ln.strip() for ln in self.tail if "Error" in ln]
            self.error = f"engine failed to start: {errors[-1] if errors else 'no READY'}"
        return self.info is not None

    def send(self, cmd: dict) -> dict:
        """One command to the child (see worker_main), its answer."""
        fail = {"ok": False, "policy": self.cfg["policy"], "ctx": self.cfg["ctx"]}
        if self.info is None or self.proc.poll() is not None:
            return {**fail, "error": self.error[:300]}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        res = self.read(RESULT_MARKER)
        if res is None:
            sys.stderr.write("".join(self.tail))
            self.error = f"worker exited ({self.proc.wait()})"
            return {**fail, "error": self.error}
        return res

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        for _ in self.proc.stdout:  # drain until the child exits
            pass
        self.proc.wait()


def run_point(workers: dict, batch: int) -> dict[str, dict]:
    """One point on every engine, their steps interleaved in interleave.py's
    turn order (`take_turns`), so step k of each engine runs within one round
    of step k of the others, and every engine's steps follow its own or
    another's alike (the order reversed every other round, as before, gave
    the middle engines of three or more no step after their own). Returns
    policy -> result."""
    started = {p: w.send({"start": batch}) for p, w in workers.items()}

    def step(p: str, _warm: bool) -> bool:
        r = workers[p].send({"step": 1})
        if not r.get("ok"):
            started[p] = r
        return bool(r.get("ok") and r["more"])

    take_turns([p for p, r in started.items() if r.get("ok")], step)
    out = {}
    for p, w in workers.items():
        r = w.send({"result": 1}) if started[p].get("ok") else started[p]
        out[p] = {**r, "policy": p, "batch": batch, "ctx": w.cfg["ctx"]}
    return out


def run_context(ctx: int, batches: list[int], policies: list[str], args) -> list[dict]:
    """All points of one ctx: one engine per policy, alive together."""
    workers = {p: Worker(engine_config(p, ctx, max(batches), args), args.verbose)
               for p in policies}
    for p, w in workers.items():
        ok = w.ready()
        _log(f"ctx {ctx}: {p} engine " + (f"ready in {w.info['init_s']:.0f}s" if ok
                                          else "FAILED to start"))
    runs: dict[int, list[dict[str, dict]]] = {}
    try:
        for rep in range(args.repeats):
            for b in batches:
                res = run_point(workers, b)
                runs.setdefault(b, []).append(res)
                for r in res.values():
                    _log(_summary(r))
    finally:
        for w in workers.values():
            w.close()
    return [r for reps in runs.values() for r in median_repeat(reps)]


def overhead(stock: dict, plugin: dict) -> float | None:
    """Relative mean-decode-step overhead of one interleaved run, or None."""
    if not (stock.get("ok") and plugin.get("ok") and stock["mean_ms"] and plugin["mean_ms"]):
        return None
    return plugin["mean_ms"] / stock["mean_ms"] - 1


def median_repeat(reps: list[dict[str, dict]]) -> list[dict]:
    """Per plugin policy, the repeat whose overhead against stock (in the same
    interleaved run) is the median one, with that repeat's stock run attached
    as "stock" and every repeat's overhead as "repeat_overheads"; stock's own
    row is its fastest repeat (prefill: the fastest of all)."""
    out = []
    stock_runs = [rep["none"] for rep in reps]
    ok = [r for r in stock_runs if r.get("ok")]
    stock = dict(min(ok, key=lambda r: r["mean_ms"])) if ok else stock_runs[0]
    out.append(stock)
    for p in [p for p in reps[0] if p != "none"]:
        scored = [(o, i) for i, rep in enumerate(reps)
                  if (o := overhead(rep["none"], rep[p])) is not None]
        if not scored:
            out.append(reps[0][p])
            continue
        _, mid = sorted(scored)[(len(scored) - 1) // 2]  # the lower median
        out.append(dict(reps[mid][p], stock=reps[mid]["none"],
                        repeat_overheads=[o for o, _ in scored]))
    return out


def _summary(r: dict) -> str:
    head = f"{r['policy']:>9} batch {r['batch']:>3} ctx {r['ctx']:>5}: "
    if not r.get("ok"):
        return head + f"FAILED {r.get('error')}"
    return head + (f"{fmt(r['mean_ms'], '.1f')} ms/step mean, {fmt(r['median_ms'], '.1f')} "
                   f"median over {r['decode_steps']} decode steps, {r['compactions']} "
                   f"compactions, prefill {r['prefill_s']:.1f}s, wall {r['wall_s']:.1f}s")


def _log(msg: str) -> None:
    print(f"[scaling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- reporting


def rows(results: list[dict]) -> list[tuple[dict, dict]]:
    """(stock, plugin) pairs of the same point, by batch then ctx: the stock
    run interleaved with that plugin run where there is one."""
    stock = {(r["batch"], r["ctx"]): r for r in results if r["policy"] == "none"}
    pairs = [(r.get("stock") or stock.get((r["batch"], r["ctx"]), {}), r)
             for r in results if r["policy"] != "none"]
    return sorted(pairs, key=lambda sp: (sp[1]["batch"], sp[1]["ctx"]))


def table(results: list[dict]) -> str:
    cols = ["batch", "ctx", "policy", "stock ms/step", "plugin ms/step", "overhead ms",
            "overhead %", "overhead of each repeat", "median ms stock / plugin", "compactions (per req)",
            "scoring ms/step", "compaction ms/step", "bookkeeping ms/step", "other ms/step",
            "CPU ms/step stock / plugin (overhead)", "resident tok/req stock / plugin"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for s, p in rows(results):
        lines.append("| " + " | ".join(str(c) for c in _cells(s, p)) + " |")
    return "\n".join(lines)


def _cells(s: dict, p: dict) -> list:
    head = [p["batch"], p["ctx"], p["policy"]]
    if not (s.get("ok") and p.get("ok")):
        err = p.get("error") if not p.get("ok") else s.get("error", "no stock run")
        return head + [f"FAILED: {err}"] + [""] * 12
    over = p["mean_ms"] - s["mean_ms"]
    bd = p["breakdown_ms"]
    other = over - sum(bd.values())
    return head + [
        f"{s['mean_ms']:.1f}", f"{p['mean_ms']:.1f}", f"{over:+.1f}",
        f"{100 * over / s['mean_ms']:+.1f}%",
        ", ".join(f"{100 * o:+.1f}%" for o in p.get("repeat_overheads", [])) or "-",
        f"{s['median_ms']:.1f} / {p['median_ms']:.1f}",
        f"{p['compactions']} ({p['compactions'] / p['batch']:.1f})",
        *(f"{bd[c]:.2f}" for c in CATEGORIES), f"{other:+.2f}", _cpu(s, p),
        f"{s['resident']:.0f} / {p['resident']:.0f}"]


def _cpu(s: dict, p: dict) -> str:
    if s.get("mean_cpu_ms") is None or p.get("mean_cpu_ms") is None:
        return "-"
    return (f"{s['mean_cpu_ms']:.1f} / {p['mean_cpu_ms']:.1f} "
            f"({100 * (p['mean_cpu_ms'] / s['mean_cpu_ms'] - 1):+.1f}%)")


def prefill_table(results: list[dict]) -> str:
    """Stock's and the plugin's prefill of each point (the whole batch in one step)."""
    lines = ["| batch | ctx | policy | stock prefill s | plugin prefill s | plugin / stock "
             "| CPU s stock / plugin (ratio) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for s, p in rows(results):
        if s.get("ok") and p.get("ok"):
            cpu = "-" if "prefill_cpu_s" not in p else (
                f"{s['prefill_cpu_s']:.1f} / {p['prefill_cpu_s']:.1f} "
                f"({p['prefill_cpu_s'] / s['prefill_cpu_s']:.2f}x)")
            lines.append(f"| {p['batch']} | {p['ctx']} | {p['policy']} | {s['prefill_s']:.1f} | "
                         f"{p['prefill_s']:.1f} | {p['prefill_s'] / s['prefill_s']:.2f}x | {cpu} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_pct) = plt.subplots(1, 2, figsize=(12, 4.5))
    pairs = [(s, p) for s, p in rows(results) if s.get("ok") and p.get("ok")]
    lines = sorted({(p["policy"], p["batch"]) for _, p in pairs})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    batches = sorted({b for _, b in lines})
    for policy, b in lines:
        pts = sorted((p["ctx"], s, p) for s, p in pairs if p["policy"] == policy
                     and p["batch"] == b)
        x = [c for c, _, _ in pts]
        color = colors[batches.index(b) % len(colors)]
        style = "-" if policy == "h2o" else ":"
        ax_ms.plot(x, [s["mean_ms"] for _, s, _ in pts], "--", color=color, marker="o",
                   mfc="none")
        ax_ms.plot(x, [p["mean_ms"] for _, _, p in pts], style, color=color, marker="o",
                   label=f"batch {b} ({policy})")
        ax_pct.plot(x, [100 * (p["mean_ms"] / s["mean_ms"] - 1) for _, s, p in pts], style,
                    color=color, marker="o", label=f"batch {b} ({policy})")
    for ax in (ax_ms, ax_pct):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.grid(alpha=0.3)
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("mean ms per decode step")
    ax_ms.set_title("stock dashed (open), plugin solid", fontsize=9)
    ax_ms.legend(fontsize=8)
    ax_pct.set_ylabel("plugin overhead vs stock (%)")
    ax_pct.axhline(0, color="gray", lw=0.8)
    ax_pct.set_title("(plugin - stock) / stock, mean decode step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results, skipped, args, wall: float, cmd: str) -> str:
    heads = sorted({f"{r.get('git_head')}/{r.get('plugin_sha1')}" for r in results
                    if r.get("ok") and r["policy"] != "none"})
    out = [f"## Decode-step cost vs batch and context: stock vLLM vs plugin "
           f"({'quick' if args.quick else 'full'})", "",
           f"command: `{cmd}`  ",
           f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; host {platform.node()}, "
           f"{_cpu_model()}, affinity {sorted(os.sched_getaffinity(0))}  ",
           f"model {Path(args.model).name}, {args.dtype}, KV cache {args.kv_cache_dtype}, "
           f"block {BLOCK_SIZE}, max_model_len "
           f"{MAX_MODEL_LEN}, enforce_eager, prefix caching off, greedy, ignore_eos; "
           f"{args.decode} decode tokens per request; plugin budget = ctx  ",
           f"plugin source (git/sha1): {', '.join(heads) or '-'}  ",
           "scoring path: " + ", ".join(sorted({f"{r['policy']}@{r['ctx']}: {r.get('scoring_path')}"
                                               for r in results if r.get("ok")
                                               and r["policy"] != "none"})) + "  ",
           f"total wall time {wall / 60:.1f} min", "", table(results), ""]
    if skipped:
        out.append("skipped: " + "; ".join(f"batch {b} x ctx {c} ({why})"
                                          for b, c, why in skipped))
    out.append("\nms/step = mean over decode steps (all requests decoding); overhead = "
               "plugin - stock means; breakdown = plugin time per decode step by timers "
               "(see the docstring of benchmarks/scaling.py); resident = mean tokens "
               "attended per request; CPU ms/step = this process's CPU time per decode "
               "step (engine and worker run in it), which another process on the machine "
               "cannot inflate as it does wall time.")
    out += ["", "Prefill in the same run:", "", prefill_table(results)]
    return "\n".join(out)


def _cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: embedded SmolLM2-135M)")
    p.add_argument("--policies", nargs="+", default=["h2o"],
                   choices=[x for x in POLICIES if x != "none"],
                   help="plugin policies to compare with stock (default h2o)")
    p.add_argument("--batches", nargs="+", type=int, default=None,
                   help="default 1 8 32 128")
    p.add_argument("--contexts", nargs="+", type=int, default=None,
                   help="prompt lengths in tokens (default 256 1024 4096 8000)")
    p.add_argument("--decode", type=int, default=None,
                   help="decode tokens per request (default 96 = 3 blocks)")
    p.add_argument("--kv-cap", type=int, default=None,
                   help="skip points with batch * ctx above this many tokens (default 65536)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every point, stock and plugin alternating; the fastest "
                        "mean decode step of each side is reported (default 1)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"],
                   help="KV cache dtype of every engine, stock and plugin (fp8: vLLM's CPU "
                        "backend needs AVX-512)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: batches 1 4, contexts 256 512, decode 96")
    p.add_argument("--json", metavar="OUT.json", help="write raw results")
    p.add_argument("--plot", metavar="OUT.png", help="ms/step and overhead %% vs ctx")
    p.add_argument("--md", metavar="OUT.md", help="also write the report (markdown)")
    p.add_argument("--verbose", action="store_true", help="show the engines' logs")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    defaults = dict(batches=[1, 4] if q else [1, 8, 32, 128],
                    contexts=[256, 512] if q else [256, 1024, 4096, 8000],
                    decode=96, kv_cap=65536)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.decode < 2 * BLOCK_SIZE:
        p.error(f"--decode must be >= {2 * BLOCK_SIZE} for a compaction per request")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(json.loads(args._worker))
        return 0
    if args.model is None:
        from vllm_kvevict.models import ensure_smollm2

        args.model = ensure_smollm2()
    points, skipped = grid(sorted(args.batches), sorted(args.contexts), args.decode,
                           args.kv_cap)
    for b, c, why in skipped:
        _log(f"skipping batch {b} x ctx {c}: {why}")
    policies = ["none", *args.policies]
    t0 = time.perf_counter()
    results = []
    for ctx in sorted({c for _, c in points}):
        results += run_context(ctx, [b for b, c in points if c == ctx], policies, args)
    wall = time.perf_counter() - t0
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # taskset shows as the affinity
    cmd = " ".join(([f"VLLM_CPU_OMP_THREADS_BIND={bind}"] if bind else [])
                   + [os.path.relpath(sys.executable)] + sys.argv)
    text = report(results, skipped, args, wall, cmd)
    print(text, flush=True)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "_worker"},
             "command": cmd, "total_s": wall, "skipped": skipped, "results": results},
            indent=1))
        _log(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        _log(f"wrote {args.plot}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
