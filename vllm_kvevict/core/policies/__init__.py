"""Eviction policies: what each records per step and how it scores the cache at
a compaction (base.py says the interface), one file per policy, and the
registry `--kv-eviction` reads.

  base.py       EvictionPolicy (the base owns top-k: `recent_plus_top_scored`),
                Record (what the engine records per step), CompactionContext
                (what a policy may read at a compaction), DenseContext
  h2o.py        H2O: accumulated attention (Record.ATTENTION)
  streaming.py  StreamingLLM: sinks + recent, by age alone (Record.NOTHING)
  window.py     the observation-window base of SnapKV and AnDPro (Record.QUERIES)
  snapkv.py     SnapKV: the window's attention
  andpro.py     AnDPro: the window's value projection

Adding a policy is one file here with one class (its `records` and
`compaction_scores`), one line in `POLICIES`, and a reference test; the tests
that cover every policy are parametrized over `POLICIES` (docs/design.md,
"Adding a policy", works one through). The prefix cache and prompt modules
follow from `records` (integration/spec.py): a policy whose scores live per
slot scores a request's shared first blocks in private rows
(core/scoring/private_scores.py); a window policy's window is the newest
queries the request computed, so after a prefix hit it holds the uncached end
of the prompt (at most `window` tokens, at least one).

InfiniGen offload is not a policy: it is a mode (`EvictionConfig.offload`) that
keeps what the policy evicts on the host; `--kv-eviction infinigen` means
`streaming` with offload on (core/config/flags.py).
"""

from __future__ import annotations

from vllm_kvevict.core.policies.andpro import AnDProPolicy
from vllm_kvevict.core.policies.base import (
    CompactionContext,
    DenseContext,
    EvictionPolicy,
    PolicySettingError,
    Record,
    _lowest,
    recent_plus_top_scored,
)
from vllm_kvevict.core.policies.h2o import H2OPolicy
from vllm_kvevict.core.policies.snapkv import SnapKVPolicy
from vllm_kvevict.core.policies.streaming import StreamingPolicy
from vllm_kvevict.core.policies.window import WindowPolicy

__all__ = [
    "POLICIES", "make_policy", "EvictionPolicy", "Record", "CompactionContext",
    "DenseContext", "PolicySettingError", "recent_plus_top_scored",
    "H2OPolicy", "StreamingPolicy", "WindowPolicy", "SnapKVPolicy", "AnDProPolicy",
]

# --kv-eviction name -> the policy that decides what stays resident.
POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (H2OPolicy, StreamingPolicy, SnapKVPolicy, AnDProPolicy)
}


def make_policy(name: str, sink: int = 4, window: int = 32) -> EvictionPolicy:
    """The policy `--kv-eviction name` runs, with the settings it takes."""
    if name not in POLICIES:
        raise ValueError(f"no eviction policy named {name!r}")
    return POLICIES[name].build(sink, window)
