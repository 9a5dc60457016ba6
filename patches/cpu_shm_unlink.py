"""TARGET: vllm.distributed.device_communicators.cpu_communicator
           ._CPUSHMDistributed._init_cpu_shm

WHY: on CPU, each rank of a TP or PP group creates a POSIX shared-memory
     segment `{ident}-{group}-[ranks]-cpushm_{rank}` (4 MiB a thread) with
     O_EXCL, and the others map it by name. vLLM unlinks them only in a C++
     static destructor, which never runs in a worker that is killed or leaves
     through os._exit: every TP 2 / PP 2 engine the suite ran left its
     segments in /dev/shm (134 of them, 536 MiB, on one machine in a day).
     Under Ray, `ident` is the port of the distributed init method, so the
     names repeat: once an engine drew the port of a killed one, its rank
     failed to start with "create shm in SHMManager failed. errno: 17"
     (EEXIST; the CI run of 3c73b63, tests/test_pipeline_parallel.py's Ray
     run).
HOW: wrap `_init_cpu_shm`, which creates this rank's segment, maps every
     rank's (join) and ends on a group barrier, so when it returns every rank
     has mapped every segment and nothing opens them by name again. Then each
     rank unlinks its own segment's name: the memory lives while a mapping
     does and is freed when the last process unmaps or dies, however it dies.
     Before, each rank unlinks a segment already under its name: with the
     names unlinked after every start, one that exists is a dead engine's.
UPSTREAM: shm_unlink each rank's segment after the join barrier in
     csrc/cpu/shm.cpp (or name segments by a random id, as the mp executor's
     file:// init method already does).
"""

from __future__ import annotations

from . import mark_patched


def _unlink(name: str) -> None:
    """shm_unlink(name); a name already gone is fine."""
    from _posixshmem import shm_unlink  # the call Python's shared_memory makes

    try:
        shm_unlink(name)
    except FileNotFoundError:
        pass


def segment_name(group_name: str, rank: int) -> str:
    """The name of a group's segment for `rank` (SHMManager::get_shm_name)."""
    return f"{group_name}_{rank}"


def apply() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    def _init_cpu_shm(self) -> int:
        name = segment_name(self.group_name, self.communicator.rank)
        _unlink(name)  # a dead engine's, same name (see WHY)
        handle = _init_cpu_shm.__kvevict_original__(self)
        _unlink(name)  # every rank has mapped it: the name may go
        return handle

    mark_patched(_CPUSHMDistributed, "_init_cpu_shm", _init_cpu_shm)
