"""The plugin's settings inside vLLM: parsed in one place, read everywhere.

`EvictionConfig.from_dict` is called here and nowhere else. At engine-config
time (patches/engine_args.py) the `--kv-*` flags are parsed and checked, and
`additional_config` gets their canonical form (`EvictionConfig.to_dict`), the
JSON-safe dict vLLM hashes and carries to every process (API server, engine
core, each worker, over `mp` or Ray). Every reader in those processes asks
`eviction_config(vllm_config)`: the dict is parsed once per process and the
same frozen value is returned after that. The KV cache spec carries that value
itself to the scheduler's block manager.

`parallel_ranks` is the one reader of where a worker sits among the engine's
workers (its TP rank picks its KV heads; its global rank labels its metrics).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_kvevict.core.config.settings import EvictionConfig


def _parse(raw: Any) -> EvictionConfig:
    return EvictionConfig.from_dict(raw)  # the one call site


@functools.lru_cache(maxsize=64)
def _parse_items(items: tuple[tuple[str, Any], ...]) -> EvictionConfig:
    return _parse(dict(items))


def eviction_config(source: Any = None) -> EvictionConfig:
    """The eviction settings of a VllmConfig, or of an `additional_config`
    dict (None: the VllmConfig being built or run in this process). Raises
    EvictionConfigError naming the flag for a bad value."""
    if source is None:
        from vllm.config import get_current_vllm_config

        source = get_current_vllm_config()
    raw = source if isinstance(source, dict) or source is None else source.additional_config
    if raw is not None and not isinstance(raw, dict):
        return _parse(raw)  # not a dict: the parser names the mistake
    items = tuple(sorted((k, v) for k, v in (raw or {}).items() if k.startswith("kv_")))
    try:
        hash(items)
    except TypeError:  # an unhashable value (a list...): uncached, to its error
        return _parse(dict(items))
    return _parse_items(items)


def parallel_ranks() -> tuple[int, int, int]:
    """This process's (pipeline stage, TP size, TP rank) in vLLM's parallel
    groups; (0, 1, 0) where there are none (unit tests, a lone process)."""
    try:
        from vllm.distributed import get_pp_group, get_tp_group

        tp = get_tp_group()
        return get_pp_group().rank_in_group, tp.world_size, tp.rank_in_group
    except Exception:  # no parallel groups: one rank
        return 0, 1, 0


def canonical(additional_config: dict | None) -> dict:
    """`additional_config` with its `kv_*` keys replaced by their parsed,
    canonical form; other keys untouched. Unchanged when no `kv_*` key is set."""
    if additional_config is not None and not isinstance(additional_config, dict):
        _parse(additional_config)  # raises: the parser names the mistake
    raw = dict(additional_config or {})
    if not any(k.startswith("kv_") for k in raw):
        return raw
    cfg = eviction_config(raw)
    return {**{k: v for k, v in raw.items() if not k.startswith("kv_")}, **cfg.to_dict()}
