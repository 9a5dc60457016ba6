"""How the engine ends up on our backend on CUDA.

vLLM 0.32 picks an attention backend per layer in
``vllm.v1.attention.selector.get_attn_backend``: it passes
``vllm_config.attention_config.backend`` to the platform, and the CUDA platform
(``CudaPlatformBase.get_attn_backend_cls``) takes an explicitly selected
backend as is (``backend.get_class()``, then ``validate_configuration``).
So two steps, both cheap and GPU-free:

  1. ``register_cuda_backend()`` (from ``vllm_kvevict.register()`` in every
     process): ``AttentionBackendEnum.CUSTOM`` -> our FLASH_ATTN wrapper. The
     class path is a string, so nothing is imported until vLLM selects it.
  2. ``select_attention_backend(engine_args, cfg)`` (from the engine-args patch,
     before ``create_engine_config`` builds the config): with eviction on a
     CUDA platform, request CUSTOM as ``--attention-backend CUSTOM`` would,
     and keep async scheduling off (unverified with eviction).
     Eviction off: nothing changes and the stock selection runs.
"""

from __future__ import annotations

from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError

CUDA_BACKEND = "vllm_kvevict.integration.cuda_backend.EvictingFlashAttentionBackend"


def register_cuda_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)


def select_attention_backend(engine_args, cfg: EvictionConfig, platform=None) -> None:
    """Point ``engine_args`` at CUSTOM when eviction is on and the platform is CUDA.

    ``platform`` defaults to ``vllm.platforms.current_platform``. A backend the
    user chose explicitly (``--attention-backend`` or ``--attention-config``)
    other than CUSTOM cannot evict, so it stops startup naming both flags.
    """
    if not cfg.enabled:
        return
    if platform is None:
        from vllm.platforms import current_platform as platform
    if not platform.is_cuda():
        return
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # Async scheduling overlaps step t+1's scheduling (and its compaction plans)
    # with step t's forward. Never verified with eviction on a GPU, so it stays
    # off unless asked for, and asking for both is refused.
    if engine_args.async_scheduling:
        raise EvictionConfigError(
            "--kv-eviction has not been verified with --async-scheduling; "
            "drop --async-scheduling (it is off by default with eviction)")
    engine_args.async_scheduling = False
    custom = AttentionBackendEnum.CUSTOM
    # vLLM parses strings ("auto" -> None) with this same validator.
    chosen = (AttentionConfig.validate_backend_before(engine_args.attention_backend)
              or engine_args.attention_config.backend)
    if chosen is None:
        engine_args.attention_backend = custom
    elif chosen is not custom:
        raise EvictionConfigError(
            f"--kv-eviction on CUDA runs on the plugin's FlashAttention wrapper "
            f"(--attention-backend CUSTOM); it cannot use --attention-backend {chosen.name}")
