"""vllm_kvevict: keep only the KV cache a request needs, inside vLLM.

Importing this package patches nothing. vLLM calls `register()` (entry point
`vllm.general_plugins`) in every process; it checks that vLLM is the release
this plugin was built against (`VLLM_VERSION`), registers our attention backend
and applies the patches listed in `vllm_kvevict.patches`.

The pin: `VLLM_VERSION` is the one release, which scripts/setup.sh installs
and register() requires; pyproject.toml declares its series (`vllm==0.32.*`)
for pip, and tests/test_packaging.py holds the two together.
"""

from __future__ import annotations

__all__ = ["EvictionConfig", "EvictionConfigError", "register"]

VLLM_VERSION = "0.32.0"  # the one vLLM pin: scripts/setup.sh installs it, register() checks it
_registered = False


def __getattr__(name: str):
    # Lazily: `import vllm_kvevict.eval.tasks` (the kvpress venv) must not import torch.
    if name in ("EvictionConfig", "EvictionConfigError"):
        from vllm_kvevict.core.config.settings import settings as config

        return getattr(config, name)
    raise AttributeError(f"module 'vllm_kvevict' has no attribute {name!r}")


def _check_vllm_version() -> None:
    import vllm

    if vllm.__version__.split("+")[0] != VLLM_VERSION:
        raise RuntimeError(f"vllm_kvevict needs vLLM {VLLM_VERSION}, found {vllm.__version__}")


def register() -> None:
    """vLLM general-plugin entry point: idempotent and cheap."""
    global _registered
    if _registered:
        return
    _check_vllm_version()
    # No gc.unfreeze at exit here (there was one): vLLM freezes the heap of
    # the processes it starts, and unfreezing made an API server's exit free
    # all of it, 2.2-2.8 s of CPU against stock's 0.25 s and over 30 s under
    # load (scripts/measure/exit_cost.py), to hide the one nanobind leak
    # report stock vLLM's own server prints. A served process exits as
    # stock's; in-process engines: vllm_kvevict/inprocess.py.
    from vllm_kvevict.triton_kernels import free_top_level_name

    free_top_level_name()  # before vLLM probes for OpenAI's `triton_kernels`
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_kvevict.patches import apply_all

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN,
                         "vllm_kvevict.integration.cpu_backend.EvictingCPUAttentionBackend")
    elif current_platform.is_cuda():
        from vllm_kvevict.integration.backend_select import register_cuda_backend

        register_cuda_backend()
    apply_all()
    from vllm_kvevict.integration.offload_connector import register as register_connector

    register_connector()  # the KV connector offload configures (--kv-swap-space)
    from vllm_kvevict.integration.metrics import register_collector

    register_collector()  # eviction counters on the API server's /metrics
    _registered = True
