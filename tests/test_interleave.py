"""benchmarks/interleave.py: engines stepped in turn, each timed by its own
steps; and throughput.py's capacity over the steps every engine was full.

The children here step a stand-in engine (a sleep) rather than vLLM: what is
under test is the turn-taking and the clock, which do not depend on what a
step does. The benchmarks that use it run real engines."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from interleave import StepClock, run_interleaved  # noqa: E402

# A child with a stand-in engine: `steps` steps of `sleep` seconds each, every
# step logged ("name start-time") to `log`; the result is its StepClock's view.
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from common import RESULT_MARKER
from interleave import StepClock
name, steps, sleep, log = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]

class Engine:
    def step(self):
        with open(log, "a") as f:
            f.write(f"{name} {time.monotonic()}\\n")
        time.sleep(sleep)

engine = Engine()
clock = StepClock(engine, gated=True)
t0 = time.perf_counter()
for _ in range(steps):
    engine.step()
wall = time.perf_counter() - t0
print(RESULT_MARKER + json.dumps({"name": name, "busy_s": clock.busy_s, "wall_s": wall,
                                  "steps": len(clock.times), "warm": clock.warm}), flush=True)
"""


def child(name: str, steps: int, sleep: float, log: Path):
    return ([sys.executable, "-c", CHILD, str(BENCH), name, str(steps), str(sleep), str(log)],
            dict(os.environ))


def _steps(log: Path) -> list[tuple[str, float]]:
    """(child name, start time) of every step, in the order they ran."""
    return [(name, float(t)) for name, t in (line.split() for line in log.read_text().splitlines())]


def test_engines_take_turns_and_each_is_timed_by_its_own_steps(tmp_path):
    log = tmp_path / "steps.log"
    out = run_interleaved([child("a", 4, 0.01, log), child("b", 5, 0.08, log)])
    assert [rc for _, rc, _ in out] == [0, 0], [tail for _, _, tail in out]
    # three steps a turn (one after the other engine, two after its own), in a
    # fixed cycle; once a has finished, b goes on alone
    assert [name for name, _ in _steps(log)] == list("aaabbbabb")
    a, b = (res for res, _, _ in out)
    assert (a["steps"], b["steps"]) == (4, 5)
    # warm: the step came right after the child's own (a turn's first follows the other's)
    assert a["warm"] == [False, True, True, False]
    assert b["warm"] == [False, True, True, False, True]
    # a's wall time includes waiting for b's 0.08 s steps; its clock does not
    assert a["wall_s"] > 0.15
    assert 0.03 <= a["busy_s"] < 0.1
    assert b["busy_s"] >= 0.4


def test_settle_pauses_before_every_turn_and_the_clocks_do_not_count_it(tmp_path):
    """--settle-ms: the last engine's threads get time to stop spinning
    before the next engine's step starts; no engine's step time includes it."""
    log = tmp_path / "steps.log"
    out = run_interleaved([child("a", 4, 0.0, log), child("b", 4, 0.0, log)], settle_s=0.05)
    assert [rc for _, rc, _ in out] == [0, 0], [tail for _, _, tail in out]
    steps = _steps(log)
    assert [name for name, _ in steps] == ["a", "a", "a", "b", "b", "b", "a", "b"]
    # a turn starts settle_s or more after the last step began
    gaps = [t1 - t0 for (n0, t0), (n1, t1) in zip(steps, steps[1:]) if n1 != n0]
    assert len(gaps) == 3 and min(gaps) >= 0.05
    assert all(res["busy_s"] < 0.04 for res, _, _ in out)  # 4 steps of nothing each


def test_a_child_that_fails_is_reported_and_the_others_finish(tmp_path):
    log = tmp_path / "steps.log"
    bad = ([sys.executable, "-c", "import sys; print('boom', flush=True); sys.exit(3)"],
           dict(os.environ))
    out = run_interleaved([bad, child("a", 2, 0.0, log)])
    (res_bad, rc_bad, tail_bad), (res_a, rc_a, _) = out
    assert res_bad is None and rc_bad == 3 and "boom" in tail_bad
    assert rc_a == 0 and res_a["steps"] == 2


def test_an_ungated_clock_does_not_wait():
    class Engine:
        def step(self):
            time.sleep(0.01)
            return "out"

    engine = Engine()
    clock = StepClock(engine, gated=False)
    assert engine.step() == "out" and engine.step() == "out"
    assert len(clock.times) == 2 and clock.busy_s >= 0.02 and clock.last_s == clock.times[-1]
    assert clock.warm == [False, True]  # a lone engine's every step after the first


def _steady_run(full, tokens, step_s, running, pool_multiple=1):
    return {"ok": True, "pool_multiple": pool_multiple, "step_full": full,
            "step_tokens": tokens, "step_s": step_s, "step_running": running,
            "step_warm": [k % 2 == 1 for k in range(len(full))],
            "capacity_steps": sum(full), "capacity_out_tok_s": 1.0,
            "capacity_mean_running": 1.0, "capacity_ms_per_step": 1.0}


def test_paired_capacity_takes_the_steps_every_engine_on_the_pool_was_full():
    import throughput
    stock = _steady_run([1, 1, 1, 0, 1], [1, 2, 3, 4, 5], [0.1] * 5, [2, 2, 2, 2, 2])
    plugin = _steady_run([0, 1, 1, 1, 1, 1], [10, 20, 30, 40, 50, 60], [0.5] * 6,
                         [4, 4, 6, 6, 6, 6])
    bigger = _steady_run([0, 0, 1, 0], [7, 7, 7, 7], [0.2] * 4, [8] * 4, pool_multiple=5)
    throughput.paired_capacity([stock, plugin, bigger])
    # steps 1, 2 and 4: both engines on the constrained pool had requests waiting
    assert stock["capacity_steps"] == plugin["capacity_steps"] == 3
    assert stock["capacity_out_tok_s"] == pytest.approx((2 + 3 + 5) / 0.3)
    assert plugin["capacity_out_tok_s"] == pytest.approx((20 + 30 + 50) / 1.5)
    assert plugin["capacity_mean_running"] == pytest.approx((4 + 6 + 6) / 3)
    assert plugin["own_capacity_steps"] == 5 and plugin["capacity_paired"]
    # the larger stock pool is not paired: its own stretch
    assert bigger["capacity_steps"] == 1 and not bigger["capacity_paired"]
    assert bigger["capacity_out_tok_s"] == pytest.approx(7 / 0.2)
    # warm: of those, the steps right after each engine's own (odd k here)
    assert stock["capacity_warm_steps"] == plugin["capacity_warm_steps"] == 1
    assert plugin["capacity_warm_out_tok_s"] == pytest.approx(20 / 0.5)
    assert stock["capacity_warm_ms_per_step"] == pytest.approx(100)


def test_windowed_stock_runs_beside_stock_but_is_never_the_baseline(tmp_path):
    """--stock-windows: stock vLLM on the same pool with every layer windowed
    (vLLM frees the blocks behind the window itself) is a row of its own; the
    speedups stay against plain stock."""
    import throughput
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    (model / "model.safetensors").write_bytes(b"weights")
    args = throughput.parse_args(["--model", str(model), "--policies", "none", "h2o",
                                  "--stock-windows", "128", "--stock-pool-multiples",
                                  "--skip-ample", "--max-num-seqs", "50"])
    constrained, _ = throughput.configs(args, str(model))
    windowed = [c for c in constrained if c.get("stock_window")]
    assert [c["workload"] if "workload" in c else "lockstep" for c in windowed] == \
        ["lockstep", "steady"]
    path = Path(windowed[0]["model"])
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 3 and cfg["sliding_window"] == 128
    assert (path / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    assert windowed[0]["pool_tokens"] == args.pool_tokens
    assert {c["max_num_seqs"] for c in constrained} == {50}  # every engine, stock included
    rows = [dict(c, ok=True) for c in constrained if c.get("workload") == "steady"]
    stock = throughput.stock_of(rows)
    assert stock["policy"] == "none" and not stock.get("stock_window")
    assert [throughput.label(r) for r in rows] == ["none", "h2o", "none, window 128"]


class _QueueEngine:
    """A stand-in for vLLM's LLMEngine under the steady workload: each step
    gives one token to each of the first `cap` unfinished requests (the rest
    wait), and returns their cumulative outputs."""

    def __init__(self, cap: int):
        self.cap, self.reqs, self.aborted = cap, {}, []

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = {"want": params.max_tokens, "ids": []}

    def step(self):
        outs = []
        for rid in list(self.reqs)[:self.cap]:
            r = self.reqs[rid]
            r["ids"].append(0)
            done = len(r["ids"]) == r["want"]
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=list(r["ids"]))]))
            if done:
                del self.reqs[rid]
        return outs

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def abort_request(self, ids):
        self.aborted += ids
        for rid in ids:
            self.reqs.pop(rid, None)

    def waiting(self):
        return max(0, len(self.reqs) - self.cap)


def test_steady_steps_stops_every_engine_at_the_horizon_with_arrivals_until_then(tmp_path):
    """--steady-steps S: S / gap requests (arrivals never stop before S), the
    run ends after step S, what still runs or waits is aborted, and every
    added request comes back in order with the tokens it had."""
    import throughput
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    args = throughput.parse_args(["--model", str(model), "--policies", "none",
                                  "--stock-pool-multiples", "--skip-ample",
                                  "--workloads", "steady", "--steady-steps", "9"])
    (cfg,), _ = throughput.configs(args, str(model))
    assert (cfg["steady_steps"], cfg["num_requests"], cfg["arrival_gap"]) == (9, 5, 2)

    engine = _QueueEngine(cap=2)
    clock = StepClock(engine, gated=False)
    rec = SimpleNamespace(running=[], last_len={}, steps=0, blocks_used=[], preemptions=0,
                          drafts=0, accepted=0, max_blocks_per_request=0, req_max={},
                          reset=lambda: None,
                          scheduler=SimpleNamespace(
                              get_request_counts=lambda: (0, engine.waiting())))
    res = throughput.timed_steady(SimpleNamespace(llm_engine=engine), rec, None,
                                  [[1, 2]] * cfg["num_requests"], cfg, clock)
    assert min(throughput.steady_lengths(cfg)) > 9  # none can finish by the horizon
    assert len(clock.times) == 9  # stopped at the horizon, not drained
    assert res["requests"] == 5  # arrivals at steps 0, 2, 4, 6, 8: all added
    assert sorted(engine.aborted) == ["0", "1", "2", "3", "4"] and not engine.reqs
    # two at a time, first come first served: request 0 got a token at each of
    # the 9 steps, request 1 from its arrival at step 2; 2-4 waited, no tokens
    assert [len(ids) for ids in res["output_token_ids"]] == [9, 7, 0, 0, 0]
    assert res["finished"] == 0
    assert res["step_full"] == [False] * 4 + [True] * 5  # a request waiting from step 4
    assert res["capacity_steps"] == 5 and res["capacity_tokens"] == 10
