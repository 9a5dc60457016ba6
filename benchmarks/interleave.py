"""Engines stepped in turn: a fair comparison on a noisy machine.

On this project's shared VMs the speed of the same matrix product flips
between two levels 1.7x apart within seconds (a neighbour on the core's
sibling). Runs of stock and the plugin minutes apart, or even back to back,
land on different levels often enough to move a ratio by +/- 30%. Stepping
the engines in turn, each in its own process, puts step k of every engine
within one round of the others, so they share the machine's state.

Child side: `StepClock(engine, gated=True)` wraps `engine.step`. Before each
step it prints STEP_MARKER and waits for a line on stdin (its turn); it then
times the step by itself (`last_s`, `busy_s`), so the wait for the others
never counts. The child prints its result line (RESULT_MARKER) when done.

Parent side: `run_interleaved(commands)` starts the children together, lets
each run to its first gated step (engine build and warm-up, untimed), then
gives each live child a turn of STEPS_PER_TURN steps in a fixed cycle, until
every child has printed its result. A turn's first step follows another
engine's step (its caches hold that engine's data), the others its own, as
every step of a lone engine does: each engine gets the same mix. Three
steps, not two: the steady workload's arrivals every second step lock each
request's compactions to one parity of the step count, which a two-step
turn would make all warm or all cold. (Earlier
runs gave one step a turn with the order reversed every other round; the
engines at either end of the order then took half their steps right after
their own, warm, and the rest none: fifty-fifth session, docs/results.md.)
Before each turn it pauses SETTLE_S: a child that has just stepped leaves
its OpenMP threads spinning (libgomp's default wait, measured here at 4-9 ms
of CPU after a region) on the cores the next child needs. A lone engine has
no such neighbour; on the 2-core EPYC the spin cost the scoring policies of
the main job 5-7 points more than stock (demo_ratio.py: snapkv 0.92x, andpro
0.92x without the pause, 0.99x / 0.97x with it, same session;
docs/results.md, twenty-sixth session). The pause is outside every child's
clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from common import RESULT_MARKER

STEP_MARKER = "@@KVEVICT_STEP@@"
WARM = "warm"  # the parent's word for a step right after the child's own
SETTLE_S = 0.02  # pause before each turn: longer than libgomp's spin after a region
STEPS_PER_TURN = 3  # one step after another engine's, two after its own (module docstring)


class StepClock:
    """Times every `engine.step()` by itself; gated: each step waits for the
    parent's word. `warm[k]`: step k came right after this engine's own step
    k - 1 (every step of an ungated clock, as of a lone engine; interleaved,
    all but the first step of a turn)."""

    def __init__(self, engine, gated: bool) -> None:
        self.gated, self.real = gated, engine.step
        self.last_s = self.busy_s = 0.0
        self.times: list[float] = []  # every step's own seconds
        self.warm: list[bool] = []
        engine.step = self.step

    def step(self):
        if self.gated:
            sys.stdout.write(STEP_MARKER + "\n")
            sys.stdout.flush()
            word = sys.stdin.readline()
            if not word:
                raise SystemExit("interleave: the parent is gone")
            self.warm.append(word.strip() == WARM)
        else:
            self.warm.append(bool(self.times))
        t = time.perf_counter()
        out = self.real()
        self.last_s = time.perf_counter() - t
        self.busy_s += self.last_s
        self.times.append(self.last_s)
        return out


class _Child:
    def __init__(self, cmd: list[str], env: dict, verbose: bool) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.verbose, self.tail, self.result = verbose, [], None

    def advance(self) -> bool:
        """Read up to its next turn (True) or its end (False)."""
        for line in self.proc.stdout:
            if line.startswith(STEP_MARKER):
                return True
            if line.startswith(RESULT_MARKER):
                self.result = json.loads(line[len(RESULT_MARKER):])
                continue
            self.tail = (self.tail + [line])[-200:]
            if self.verbose:
                sys.stderr.write(line)
        return False

    def go(self, warm: bool) -> bool:
        try:
            self.proc.stdin.write((WARM if warm else "") + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return False
        return self.advance()


def take_turns(live: list, step, settle_s: float = 0.0) -> None:
    """The turn order (module docstring): each of `live` in turn takes
    STEPS_PER_TURN steps, in a fixed cycle, until every one has ended.
    step(item, warm) takes one step and returns False once the item has
    ended; warm: the item took the step before this one. settle_s: pause
    before each turn."""
    live, last = list(live), None
    while live:
        for item in list(live):
            if settle_s:
                time.sleep(settle_s)
            for _ in range(STEPS_PER_TURN):
                warm, last = last is item, item
                if not step(item, warm):
                    live.remove(item)
                    break


def run_interleaved(commands: list[tuple[list[str], dict]], verbose: bool = False,
                    settle_s: float = SETTLE_S) -> list[tuple[dict | None, int, str]]:
    """commands: (argv, env) per child; settle_s: pause before each turn
    (module docstring). Step k of every child runs in round k // STEPS_PER_TURN.
    Returns (result or None, exit code, last lines of output) per child, in
    order."""
    children = [_Child(cmd, env, verbose) for cmd, env in commands]
    take_turns([c for c in children if c.advance()], _Child.go, settle_s)
    out = []
    for c in children:
        c.proc.stdin.close()
        out.append((c.result, c.proc.wait(), "".join(c.tail)))
    return out
