"""The metrics snapshot a busy process writes at most once an interval
(`Snapshot.write_soon`): throttled, yet its last values always reach the file,
by a timer, even when no call follows (an engine gone idle)."""
from __future__ import annotations

import json
import time

from vllm_kvevict.integration.metrics import Snapshot

INTERVAL = 0.3


def _read(snap: Snapshot) -> dict:
    with open(snap.path) as f:
        return json.load(f)


def test_write_soon_throttles_and_its_timer_writes_the_last_values(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_METRICS_DIR", str(tmp_path))
    snap = Snapshot("worker-test")
    snap.write_soon({"n": 1}, INTERVAL)  # nothing written yet: at once
    assert _read(snap) == {"n": 1}
    snap.write_soon({"n": 2}, INTERVAL)
    snap.write_soon({"n": 3}, INTERVAL)
    assert _read(snap) == {"n": 1}  # within the interval: held back
    time.sleep(INTERVAL + 0.3)
    assert _read(snap) == {"n": 3}  # the timer wrote the latest, with no call after it


def test_write_supersedes_pending_values(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_METRICS_DIR", str(tmp_path))
    snap = Snapshot("scheduler-test")
    snap.write({"n": 1})
    snap.write_soon({"n": 2}, INTERVAL)  # pending
    snap.write({"n": 5})  # e.g. the idle state, written at once
    time.sleep(INTERVAL + 0.3)
    assert _read(snap) == {"n": 5}  # the older pending values never land on top
