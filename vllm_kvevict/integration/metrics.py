"""Eviction metrics on vLLM's `/metrics` (Prometheus).

The numbers live in other processes than the one serving `/metrics`: blocks
and tokens in the engine core's KV managers, compaction time in each worker.
vLLM's own per-step stats (`SchedulerStats`) cross to the API server as a
fixed msgspec schema with no room for a plugin's fields, so each process
writes a small JSON snapshot of its cumulative counters into one directory
(`KVEVICT_METRICS_DIR`, made by the first process that loads the plugin,
which is the API server, and inherited by the processes it starts, Ray
workers included), and a
Prometheus collector in the API server sums them at scrape time. A snapshot is
rewritten only when a value changed; the scheduler's, which changes every
step, at most every `BUSY_INTERVAL` seconds while requests run and at once
when the last one leaves (per-step writes were about 2% of the demo's h2o
profile on the 2-core EPYC; the scrape sees the idle state exactly). A
worker's compaction time is written at most every `BUSY_INTERVAL` too, its
last value by a timer (`write_soon`), so an engine gone idle still shows all
of it (a write, mostly its `os.replace`, cost 0.4% of the demo's h2o steps at
four a second on the Xeon).

Counters and gauges without labels are sums over the server's engines
(`--data-parallel-size`); a worker's series carry vLLM's own `engine` label
(the data-parallel rank) and `rank` (its rank within that engine), so no two
workers of a server share one.

    vllm_kvevict_info{policy,budget,recent,sink,window}   1
    vllm_kvevict_tokens_evicted_total       tokens dropped by compactions
    vllm_kvevict_blocks_freed_total         KV blocks returned to vLLM's BlockPool
    vllm_kvevict_compactions_total          request compactions
    vllm_kvevict_prefill_fallbacks_total    of them, between prompt chunks (memory short)
    vllm_kvevict_resident_tokens{kind}      running requests' KV tokens:
                                            kind="logical" (seen), "physical" (held)
    vllm_kvevict_compaction_seconds_total{engine,rank}  worker time spent compacting
    vllm_kvevict_cpu_pass_steps_total{engine,rank}  steps whose attention came from the
                                            plugin's CPU pass, not vLLM's
    vllm_kvevict_scoring_path_info{engine,rank,path}   where a worker scores: "cpu-kernel
                                            avx512bf16|avx2", or "torch (why)"
    vllm_kvevict_host_entries_offloaded_total{engine,rank}  offload only: (layer, KV head,
                                            token) entries a worker wrote to its host tier
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
import time

ENV = "KVEVICT_METRICS_DIR"  # not VLLM_*: vLLM warns about VLLM_ names it does not know
BUSY_INTERVAL = 1.0  # seconds between a busy process's snapshots


def ensure_metrics_dir() -> str:
    """The snapshot directory; the first process to ask creates it (and
    removes it at exit) and exports it to the processes it will start."""
    path = os.environ.get(ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="vllm_kvevict-metrics-")
        os.environ[ENV] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        # mp workers inherit the environment; Ray workers get the variables
        # vLLM's Ray executor copies, which this list extends.
        extra = os.environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "")
        if ENV not in extra.split(","):
            os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] = ",".join(filter(None, [extra, ENV]))
    return path


class Snapshot:
    """One process's cumulative values, written atomically when they change."""

    def __init__(self, role: str) -> None:
        self.path = os.path.join(ensure_metrics_dir(), f"{role}-{os.getpid()}.json")
        self._last: dict | None = None
        self._written_at = float("-inf")
        self._lock = threading.Lock()  # write() runs on the caller's thread or the timer's
        self._pending: dict | None = None
        self._timer: threading.Timer | None = None

    def due(self, min_interval: float) -> bool:
        """Whether `min_interval` seconds have passed since the last write."""
        return time.monotonic() - self._written_at >= min_interval

    def write_soon(self, values: dict, min_interval: float = BUSY_INTERVAL) -> None:
        """`write` now if `min_interval` has passed since the last write, else
        once it has (a timer writes the latest values given by then), so the
        file trails the values by at most `min_interval` even if no call follows."""
        with self._lock:
            wait = self._written_at + min_interval - time.monotonic()
            if wait > 0:
                self._pending = dict(values)
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._flush)
                    self._timer.daemon = True  # never holds up the process's exit
                    self._timer.start()
                return
        self.write(values)

    def _flush(self) -> None:
        with self._lock:
            values, self._pending, self._timer = self._pending, None, None
        if values is not None:
            self.write(values)

    def write(self, values: dict) -> None:
        with self._lock:
            self._pending = None  # these are newer than any pending ones
            if values == self._last:
                return
            tmp = self.path + ".tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(values, f)
                os.replace(tmp, self.path)
            except OSError:
                return  # metrics never break serving (e.g. the directory was removed)
            self._last = dict(values)
            self._written_at = time.monotonic()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(path: str | None = None) -> list[dict]:
    path = path or os.environ.get(ENV)
    out = []
    for name in sorted(os.listdir(path)) if path and os.path.isdir(path) else ():
        if name.endswith(".json"):
            if not _alive(int(name[:-5].rsplit("-", 1)[1])):
                continue  # a finished process's engine is not this server's
            try:
                with open(os.path.join(path, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue  # replaced or removed under us: next scrape reads it
    return out


WORKER_LABELS = ["engine", "rank"]


def _worker_labels(snapshot: dict) -> list[str]:
    return [str(snapshot.get("engine", 0)), str(snapshot["rank"])]


class EvictionCollector:
    """prometheus_client custom collector over the snapshots (scrape time)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        snaps = read_snapshots()
        # One file per evictable KV group of each engine core (one, so far: a
        # hybrid model's is not group 0, its sliding-window groups write none);
        # token counts are the same in every group of one engine, blocks are per group.
        every_group = [s for s in snaps if s.get("role") == "scheduler"]
        lowest = min((s["group"] for s in every_group), default=0)
        scheduler = [s for s in every_group if s["group"] == lowest]
        workers = sorted((s for s in snaps if s.get("role") == "worker"), key=_worker_labels)
        if not scheduler and not workers:
            return  # eviction off, or nothing ran yet
        if scheduler:
            info = InfoMetricFamily("vllm_kvevict", "KV eviction settings of this server")
            info.add_metric([], {k: str(v) for k, v in scheduler[0]["config"].items()})
            yield info
            for key, doc in (
                    ("tokens_evicted", "KV tokens dropped by compactions"),
                    ("compactions", "Request compactions"),
                    ("prefill_fallbacks", "Compactions between prompt chunks because the "
                                          "pool could not hold the whole prompt (or "
                                          "--kv-prefill-cap)")):
                yield CounterMetricFamily(f"vllm_kvevict_{key}", doc,
                                          value=sum(s.get(key, 0) for s in scheduler))
            yield CounterMetricFamily(
                "vllm_kvevict_blocks_freed", "KV blocks returned to vLLM's block pool by compactions",
                value=sum(s["blocks_freed"] for s in every_group))
            resident = GaugeMetricFamily(
                "vllm_kvevict_resident_tokens",
                "KV tokens of running requests: logical (seen) vs physical (held)",
                labels=["kind"])
            for kind in ("logical", "physical"):
                resident.add_metric([kind], sum(s[f"{kind}_tokens"] for s in scheduler))
            yield resident
        if workers:
            seconds = CounterMetricFamily(
                "vllm_kvevict_compaction_seconds", "Worker time spent compacting KV",
                labels=WORKER_LABELS)
            for s in workers:
                seconds.add_metric(_worker_labels(s), s["compaction_seconds"])
            yield seconds
            steps = CounterMetricFamily(
                "vllm_kvevict_cpu_pass_steps",
                "Steps whose attention came from the plugin's CPU pass instead of vLLM's "
                "(requests that all evict anyway)", labels=WORKER_LABELS)
            for s in workers:
                steps.add_metric(_worker_labels(s), s.get("cpu_pass_steps", 0))
            yield steps
            where = InfoMetricFamily("vllm_kvevict_scoring_path", "Where each worker scores",
                                     labels=WORKER_LABELS)
            for s in workers:
                if "scoring_path" in s:
                    where.add_metric(_worker_labels(s), {"path": s["scoring_path"]})
            yield where
            offload = [s for s in workers if "host_entries_offloaded" in s]
            if offload:
                host = CounterMetricFamily(
                    "vllm_kvevict_host_entries_offloaded",
                    "(layer, KV head, token) KV entries written to the offload host tier",
                    labels=WORKER_LABELS)
                for s in offload:
                    host.add_metric(_worker_labels(s), s["host_entries_offloaded"])
                yield host


_collector: EvictionCollector | None = None


def register_collector() -> None:
    """Add the collector to prometheus_client's default registry (the one
    vLLM's single API server exposes), once per process."""
    global _collector
    if _collector is not None:
        return
    from prometheus_client import REGISTRY

    _collector = add_collector(REGISTRY)


def add_collector(registry) -> EvictionCollector:
    """A new collector, registered in `registry`: the default one
    (register_collector), or one vLLM serves /metrics from when several API
    servers share it (patches/metrics_registry.py)."""
    ensure_metrics_dir()
    collector = EvictionCollector()
    registry.register(collector)
    return collector
