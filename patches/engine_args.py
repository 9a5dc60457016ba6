"""TARGET: vllm.engine.arg_utils.EngineArgs.add_cli_args, .from_cli_args,
           .create_engine_config

WHY: `vllm serve M --kv-eviction h2o` must parse, show in --help, and reach
     every process. vLLM has no hook for plugins to add engine flags.
HOW: add an argument group; fold the parsed values into
     `additional_config` (hashed and pickled to every process by vLLM); validate
     the settings (and the budget against the block size) in
     create_engine_config, so a bad value stops startup with the flag's name.
     On CUDA with eviction on, request `--attention-backend CUSTOM` (our
     FlashAttention wrapper, see integration/backend_select.py). With offload on, set
     kv_transfer_config to our KV connector (integration/offload_connector.py,
     whose per-layer hooks carry InfiniGen's prefetch) and enforce_eager (the
     connector reads attention inputs through a Python forward hook), and
     check that InfiniGen's skewing file exists and fits the model, so a
     missing one stops startup naming `python -m vllm_kvevict.calibrate`
     instead of a worker calibrating mid-step.
     With eviction or offload on, refuse what it does not support, naming the
     vLLM flag and ours: speculative decoding, async
     scheduling, and pipeline parallel with offload (eviction alone runs at
     PP > 1: each stage compacts its own layers by the scheduler's plan). vLLM 0.32 turns async scheduling on by
     default where it can (VllmConfig: None -> True on CUDA; the CPU platform
     turns it off whatever was asked), so an unset value is set to False here
     and only an explicit --async-scheduling is refused: a plain
     `vllm serve M --kv-eviction h2o` starts. The built config is checked again.
     Cascade attention (which read the logical seq_lens of a shared prefix):
     vLLM 0.32 removed it. `disable_cascade_attn` is a deprecated no-op
     (default True; setting it only warns), the scheduler's
     num_common_prefix_blocks is always empty, and FlashAttention's builder,
     which our CUDA backend wraps (integration/backend_select.py -> CUSTOM ->
     cuda_backend.py), has no cascade path. So nothing to set or refuse;
     tests/test_unsupported_settings.py fails if an upgrade brings it back.
UPSTREAM: a plugin API to register engine CLI arguments.
"""

from __future__ import annotations

import argparse

from vllm_kvevict.core.config import (
    FLAGS,
    POLICIES,
    VICTIMS,
    EvictionConfig,
    EvictionConfigError,
)
from vllm_kvevict.integration.settings import canonical, eviction_config

from . import mark_patched

_HELP = {
    "kv_eviction": "KV cache eviction policy: h2o (heavy hitters by accumulated attention "
                   "+ recent window), streaming (attention sinks + recent window), snapkv "
                   "or andpro (tokens scored by the attention, or the value projection on "
                   "the output, of the last --kv-window queries), infinigen (sinks + recent "
                   "window resident, the rest offloaded to a host pool and fetched back "
                   "when a decode query is predicted to need it). Default: none.",
    "kv_budget": "Resident KV tokens per request: a token count (e.g. 256) or a "
                 "fraction of the request's length (e.g. 0.2). Default: 1024.",
    "kv_recent": "Recent-window size inside the budget, in the budget's unit "
                 "(H2O's recent ratio). Default: half the budget; for snapkv and "
                 "andpro, the observation window.",
    "kv_sink": "Attention-sink tokens always kept by the streaming policy. Default: 4.",
    "kv_window": "Observation window of snapkv and andpro: how many of the latest "
                 "queries score the cache at each compaction. Default: 32.",
    "kv_prefill_cap": "Resident tokens a request may hold while its prompt is prefilled "
                      "in chunks. Default: auto: the prompt stays whole while the KV pool "
                      "can hold its next chunk, and is compressed once, after its last "
                      "chunk, so the policy sees the question at its end; when the pool "
                      "is short it is compressed between chunks instead (counted in "
                      "vllm_kvevict_prefill_fallbacks_total). 0: always between chunks.",
    "kv_swap_space": "Host memory pool for offloaded KV per worker: a number of GiB, as "
                     "vLLM's --swap-space reads it (4, 0.25), or a size with a unit "
                     "(8GiB, 512MiB, 1073741824B). "
                     "With h2o/andpro/snapkv/streaming it turns offload on: evicted KV "
                     "goes to the pool instead of being dropped. Default: 4GiB under "
                     "infinigen, else no offload.",
    "kv_alpha": "Offload: fetch the host entries whose partial attention logit is "
                "above max - alpha (InfiniGen's threshold). Default: 4.",
    "kv_attend_cap": "Offload: at most this fraction of a request's tokens attended "
                     "per decode step, resident and fetched (InfiniGen's 20%% cap). "
                     "Default: 0.2.",
    "kv_partial": "Offload: fraction of the head dimension in the skewed partial "
                  "query/key that predicts attention. Default: 0.3.",
    "kv_host_victim": "Offload: which block the full host pool drops: counter "
                      "(InfiniGen), lru or fifo. Default: counter.",
    "kv_skewing": "Offload: the InfiniGen skewing file to use. Default: the one "
                  "`python -m vllm_kvevict.calibrate MODEL` wrote to its cache; startup "
                  "stops, naming that command, when there is none.",
    "kv_max_schemas": "Prompt modules: schemas that clients may register at once through "
                      "/v1/kvevict/schemas, per API server process; 0 turns registration "
                      "off. Default: 64.",
    "kv_max_pinned": "Prompt modules: share of the KV block pool that registered schemas' "
                     "module blocks may pin (e.g. 0.5 or 50%%); a schema past it is refused "
                     "with 413. Default: 0.5.",
    "kv_max_pml_bytes": "Prompt modules: largest PML text a client may send (a schema "
                        "route's body, a prompt's <prompt> element), e.g. 1MiB; checked "
                        "before parsing (413 for a schema body, 400 for a prompt). "
                        "Default: 1MiB.",
    "kv_max_modules": "Prompt modules: most <module>, <union> and <param> elements in one "
                      "schema, and most module imports in one prompt; past it, 400. "
                      "Default: 512.",
}


def _ours(cfg: EvictionConfig) -> str:
    """Our flags that turned eviction (and offload) on, as the user would write them."""
    return f"--kv-eviction {cfg.policy}" + (" --kv-swap-space" if cfg.swap_space else "")


def refuse_unsupported(cfg: EvictionConfig, *, speculative: str | None, pipeline: int,
                       async_scheduling: bool | None) -> None:
    """Stop startup when eviction/offload is on beside a setting it does not
    support; the message names the vLLM flag and ours."""
    if not cfg.enabled:
        return
    ours = _ours(cfg)
    if speculative:
        raise EvictionConfigError(
            f"{speculative} is not supported with {ours}: draft tokens' attention would "
            f"enter the eviction scores, and offload's host decode handles one new token "
            f"per request per step; drop {speculative} or the eviction flags")
    if pipeline > 1 and cfg.offload:
        # Eviction alone runs at any stage count: every stage compacts its own
        # layers by the scheduler's one plan (docs/serving.md). Offload does not.
        raise EvictionConfigError(
            f"--pipeline-parallel-size {pipeline} is not supported with {ours}: offload "
            f"predicts each layer's attention from the layer before it (InfiniGen's "
            f"speculation), and the first layer of every stage after the first has that "
            f"layer in another process; use --tensor-parallel-size to split the model, "
            f"or eviction without offload (e.g. --kv-eviction h2o) at pipeline parallel")
    if async_scheduling:
        raise EvictionConfigError(
            f"--async-scheduling is not supported with {ours}: it schedules step t+1, "
            f"and plans its compactions, while step t still runs; drop --async-scheduling "
            f"(with eviction it is off by default)")


def _speculative_flag(engine_args) -> str | None:
    """The flag that asked for speculative decoding, if any."""
    if engine_args.speculative_config:
        return "--speculative-config"
    for flag, key in (("--spec-method", "spec_method"), ("--spec-model", "spec_model"),
                      ("--spec-tokens", "spec_tokens")):
        if getattr(engine_args, key, None) is not None:
            return flag
    return None


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def add_cli_args(parser, *args, **kwargs):
        parser = add_cli_args.__kvevict_original__.__func__(parser, *args, **kwargs)
        group = parser.add_argument_group(
            "KV eviction (vllm_kvevict)",
            "Keep only the KV cache each request needs; freed blocks go back to "
            "vLLM's block pool.")
        for key, flag in FLAGS.items():
            # SUPPRESS: an unset flag leaves additional_config alone, and --help
            # shows the real default from the text instead of "(default: None)".
            group.add_argument(flag, dest=key, default=argparse.SUPPRESS, help=_HELP[key],
                               **({"choices": POLICIES} if key == "kv_eviction" else
                                  {"choices": VICTIMS} if key == "kv_host_victim" else {}))
        return parser

    def from_cli_args(cls, args):
        engine_args = from_cli_args.__kvevict_original__.__func__(cls, args)
        given = {k: getattr(args, k) for k in FLAGS if getattr(args, k, None) is not None}
        if given:
            eviction_config(given)  # fail now, naming the flag
            engine_args.additional_config = {**(engine_args.additional_config or {}), **given}
        return engine_args

    def create_engine_config(self, *args, **kwargs):
        from vllm_kvevict.integration.backend_select import select_attention_backend

        # Parsed and checked here, once: a bad value stops startup, naming its
        # flag. Every process reads the canonical form (integration/settings.py).
        self.additional_config = canonical(self.additional_config)
        cfg = eviction_config(self.additional_config)
        refuse_unsupported(cfg, speculative=_speculative_flag(self),
                           pipeline=self.pipeline_parallel_size,
                           async_scheduling=self.async_scheduling)
        if cfg.enabled:
            # None lets vLLM turn it on (CUDA); the user did not ask for it.
            self.async_scheduling = False
        if cfg.offload:
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                # Offload's decode path (integration/offload_attention.py) is
                # wired into the CPU backend only; refusing beats silently dropping.
                raise EvictionConfigError(
                    "--kv-eviction infinigen / --kv-swap-space: KV offload runs on the "
                    "CPU backend only in this release")
            if self.kv_transfer_config is not None:
                raise EvictionConfigError(
                    "--kv-eviction infinigen / --kv-swap-space: offload brings KV back "
                    "through its own KV connector and cannot be combined with "
                    "--kv-transfer-config")
            from vllm.config import KVTransferConfig

            from vllm_kvevict.integration.offload_connector import CONNECTOR_NAME

            # The connector's per-layer hooks carry the prefetch; its input
            # capture is a Python forward hook, which needs eager execution.
            self.kv_transfer_config = KVTransferConfig(kv_connector=CONNECTOR_NAME,
                                                       kv_role="kv_both")
            self.enforce_eager = True
        select_attention_backend(self, cfg)
        vllm_config = create_engine_config.__kvevict_original__(self, *args, **kwargs)
        if cfg.enabled:
            cfg.check_block_size(vllm_config.cache_config.block_size)
            # Whatever set them (a platform hook, a model's own config): not with eviction.
            refuse_unsupported(
                cfg, speculative="--speculative-config" if vllm_config.speculative_config
                else None, pipeline=vllm_config.parallel_config.pipeline_parallel_size,
                async_scheduling=vllm_config.scheduler_config.async_scheduling)
        if cfg.offload:  # before any worker: they load the file, never compute it
            from vllm_kvevict.integration.offload_attention import check_skewing

            check_skewing(vllm_config, cfg)
        return vllm_config

    mark_patched(EngineArgs, "add_cli_args", staticmethod(add_cli_args))
    mark_patched(EngineArgs, "from_cli_args", classmethod(from_cli_args))
    mark_patched(EngineArgs, "create_engine_config", create_engine_config)
