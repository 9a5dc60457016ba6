"""TARGET: prometheus_client.multiprocess.MultiProcessCollector, as vLLM's API
        server constructs it (vllm.v1.metrics.prometheus.get_prometheus_registry,
        and prometheus_fastapi_instrumentator's /metrics handler, per scrape)

WHY: with `--api-server-count` > 1 (or PROMETHEUS_MULTIPROC_DIR set) vLLM
     serves /metrics from a fresh CollectorRegistry holding only a
     MultiProcessCollector, which reads the files of prometheus_client's own
     metric classes; the /metrics handler even builds a new such registry for
     every scrape. The plugin's collector (integration/metrics.py), registered
     in the default REGISTRY, is in none of them, so every vllm_kvevict_*
     series vanished from /metrics there.
HOW: a subclass whose constructor, after the original's, adds the plugin's
     collector to the registry it was given. The counters are the engine's
     (its processes' snapshot files, one directory for the whole server), so
     every API server reports the same values. Nothing else changes: the
     subclass collects what the original does.
UPSTREAM: a hook for plugins to add collectors to the /metrics registry.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from prometheus_client import multiprocess

    class MultiProcessCollector(multiprocess.MultiProcessCollector):
        def __init__(self, registry, path=None):
            super().__init__(registry, path)
            if registry is not None:
                from vllm_kvevict.integration.metrics import add_collector

                add_collector(registry)

    mark_patched(multiprocess, "MultiProcessCollector", MultiProcessCollector)
