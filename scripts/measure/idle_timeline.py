"""Where the suite leaves cores idle: a pytest plugin and its report.

    PYTHONPATH=scripts/measure .venv/bin/python -m pytest -q -p idle_timeline
    .venv/bin/python scripts/measure/idle_timeline.py /tmp/idle_timeline.jsonl

The pytest process samples the machine's idle CPU (/proc/stat) every second;
each xdist worker logs when each test file's tests start and end. The report
charges every second of idle CPU to the files running on the workers at that
moment (half each when two run), and shows when each worker finished: an
idle core the file did not use is what a better schedule could still fill.
Log: KVEVICT_IDLE_LOG (default /tmp/idle_timeline.jsonl).
"""

import collections
import json
import os
import sys
import threading
import time

LOG = os.environ.get("KVEVICT_IDLE_LOG", "/tmp/idle_timeline.jsonl")
_lock = threading.Lock()


def _write(row: dict) -> None:
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps(row) + "\n")


def _idle_jiffies() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of the whole machine since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def _sample(stop: threading.Event) -> None:
    idle, total = _idle_jiffies()
    cores = len(os.sched_getaffinity(0))
    while not stop.wait(1.0):
        i, t = _idle_jiffies()
        if t > total:  # idle cores over the last interval
            _write({"t": time.time(), "idle_cores": cores * (i - idle) / (t - total)})
        idle, total = i, t


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if os.path.exists(LOG):
        os.remove(LOG)
    stop = threading.Event()
    threading.Thread(target=_sample, args=(stop,), daemon=True).start()
    config._idle_timeline_stop = stop


def pytest_unconfigure(config):
    stop = getattr(config, "_idle_timeline_stop", None)
    if stop is not None:
        stop.set()


def pytest_runtest_protocol(item, nextitem):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _write({"worker": worker, "test": item.nodeid, "start": time.time()})


def pytest_runtest_logfinish(nodeid, location):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _write({"worker": worker, "test": nodeid, "end": time.time()})


def report(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    samples = [r for r in rows if "idle_cores" in r]
    spans = collections.defaultdict(list)  # worker -> [(start, end, file)]
    open_ = {}
    for r in rows:
        if "worker" not in r:
            continue
        if "start" in r:
            open_[(r["worker"], r["test"])] = r["start"]
        elif (r["worker"], r["test"]) in open_:
            start = open_.pop((r["worker"], r["test"]))
            spans[r["worker"]].append((start, r["end"], r["test"].split("::")[0]))
    t0 = min(s[0] for ws in spans.values() for s in ws)
    charged, running = collections.Counter(), collections.Counter()
    for s in samples:
        t = s["t"] - 0.5  # the middle of the sampled second
        now = [f for ws in spans.values() for (a, b, f) in ws if a <= t < b]
        for f in now or ["(no test running)"]:
            charged[f] += s["idle_cores"] / max(1, len(now))
    for ws in spans.values():
        for a, b, f in ws:
            running[f] += b - a
    print(f"idle core-seconds in all: {sum(s['idle_cores'] for s in samples):.0f} "
          f"over {samples[-1]['t'] - t0:.0f} s")
    for w, ws in sorted(spans.items()):
        print(f"{w}: first test at {min(a for a, _, _ in ws) - t0:.0f} s, "
              f"last ends at {max(b for _, b, _ in ws) - t0:.0f} s")
    print(f"{'idle core-s':>11} {'file s':>7}  file")
    for f, idle in charged.most_common(25):
        print(f"{idle:11.1f} {running.get(f, 0):7.1f}  {f}")


if __name__ == "__main__":
    report(sys.argv[1] if len(sys.argv) > 1 else LOG)
