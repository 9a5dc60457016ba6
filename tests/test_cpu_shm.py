"""vLLM's CPU shared-memory segments (patches/cpu_shm_unlink.py).

Each rank of a CPU TP / PP group creates `{ident}-{group}-[ranks]-cpushm_{rank}`
in /dev/shm with O_EXCL. Stock vLLM unlinks it only in a static destructor
that a killed worker never runs, and under Ray `ident` is a port, so a later
engine that drew a dead one's port failed to start (errno 17, EEXIST).
Checked:
- that hazard, in a subprocess with vLLM's own `_CPUSHMDistributed` on a
  one-rank gloo group: with a dead engine's segment under the name, stock
  fails with errno 17, and the patched start succeeds and leaves the name
  unlinked;
- in the four two-rank engines of tests/tp_runs.py's plugin process (TP 2 and
  PP 2, over `mp` and over Ray), each worker's group all-reduces through
  shared memory, and none of the group's segment names is left in /dev/shm
  once the engine has started.
"""

import json
import os
import subprocess
import sys

import pytest
from tp_runs import plugin_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A one-rank group's `_CPUSHMDistributed` start, with a segment already under
# its rank's name, as a killed engine leaves it. argv: a gloo rendezvous file,
# "stock" or "patched". Prints {"started", "error", "left"}.
STALE_START = r"""
import json, os, sys, uuid
import torch.distributed as dist
from _posixshmem import shm_open, shm_unlink
from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
from vllm.platforms import current_platform

from vllm_kvevict.patches import cpu_shm_unlink

current_platform.import_kernels()  # torch.ops._C, as a worker loads it
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)


class Communicator:  # what _CPUSHMDistributed reads of a CpuCommunicator
    rank, world_size, ranks, unique_name = 0, 1, [0], "tp:0"
    device_group = dist.group.WORLD


os.environ["VLLM_DIST_IDENT"] = "kvevict-test-" + uuid.uuid4().hex
name = cpu_shm_unlink.segment_name(_CPUSHMDistributed.make_group_name(Communicator), 0)
os.close(shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
try:
    if sys.argv[2] == "patched":
        cpu_shm_unlink.apply()
    result = {"started": True, "error": None}
    try:
        _CPUSHMDistributed(Communicator())
    except RuntimeError as e:
        result = {"started": False, "error": str(e)}
    result["left"] = os.path.exists("/dev/shm/" + name)
    print("RESULT=" + json.dumps(result))
finally:
    if os.path.exists("/dev/shm/" + name):
        shm_unlink(name)
"""


def _stale_start(tmp_path, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", STALE_START, str(tmp_path / "rdzv"), mode],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "VLLM_PLUGINS": ""})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULT="))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux only")
def test_dead_engines_segment_blocks_stock_not_the_patched_start(tmp_path):
    stock = _stale_start(tmp_path, "stock")
    assert not stock["started"] and "errno: 17" in stock["error"], stock
    patched = _stale_start(tmp_path, "patched")
    assert patched == {"started": True, "error": None, "left": False}


@pytest.mark.parametrize("run", ["h2o_tp2", "h2o_ray_tp2", "h2o_pp2", "h2o_ray_pp2"])
def test_two_rank_engines_leave_no_segment_names(run):
    workers = plugin_runs()[run]["workers"]
    group = "pp" if "pp2" in run else "tp"
    assert len(workers) == 2
    for w in workers:
        (name, left), = w["shm_segments"].items()  # the one two-rank group
        assert name.startswith(group), w["shm_segments"]
        assert left == [], w["shm_segments"]
