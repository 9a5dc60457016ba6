"""TARGET: vllm.engine.arg_utils.EngineArgs.add_cli_args, .from_cli_args,
           .create_engine_config

WHY: `vllm serve M --kv-eviction h2o` must parse, show in --help, and reach
     every process. vLLM has no hook for plugins to add engine flags.
HOW: add an argument group, one flag per entry of vllm_kvevict/core/config/flags.py's
     table (name, help, default, choices); fold the parsed values into
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
     vLLM flag and ours: async scheduling, pipeline parallel with offload
     (eviction alone runs at PP > 1: each stage compacts its own layers by the
     scheduler's plan), and speculative decoding except n-gram drafts under
     eviction alone on the CPU backend at one pipeline stage (what each of
     those would break: refuse_speculation). vLLM 0.32 turns async scheduling on by
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
     With the schema routes loaded (VLLM_PLUGINS naming kvevict_modules),
     refuse more than one API server (--api-server-count, which vLLM sets to
     the data-parallel size by default): the schema registry is per process.
UPSTREAM: a plugin API to register engine CLI arguments.
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError
from vllm_kvevict.core.config.flags import FLAGS, TABLE
from vllm_kvevict.integration.settings import canonical, eviction_config

from . import mark_patched

MODULE_ROUTES = "kvevict_modules"  # the schema routes' endpoint plugin (pyproject.toml)


def _ours(cfg: EvictionConfig) -> str:
    """Our flags that turned eviction (and offload) on, as the user would write them."""
    return cfg.as_flags()  # `--kv-eviction infinigen`, not the streaming policy it runs


def refuse_unsupported(cfg: EvictionConfig, *, pipeline: int,
                       async_scheduling: bool | None, kv_cache_dtype: str = "auto") -> None:
    """Stop startup when eviction/offload is on beside a setting it does not
    support; the message names the vLLM flag and ours."""
    if not cfg.enabled:
        return
    ours = _ours(cfg)
    if pipeline > 1 and cfg.offload:
        # Eviction alone runs at any stage count: every stage compacts its own
        # layers by the scheduler's one plan (docs/serving.md). Offload does not.
        raise EvictionConfigError(
            f"--pipeline-parallel-size {pipeline} is not supported with {ours}: offload "
            f"predicts each layer's attention from the layer before it (InfiniGen's "
            f"speculation), and the first layer of every stage after the first has that "
            f"layer in another process; use --tensor-parallel-size to split the model, "
            f"or eviction without offload (e.g. --kv-eviction h2o) at pipeline parallel")
    if cfg.offload and kv_cache_dtype.startswith("fp8"):
        # Eviction reads an fp8 cache (its float8 view, k_scale in the logits:
        # cpu_backend.readable); offload's host decode recomputes attention from
        # gathered K/V and its host tier holds the model dtype: not wired for fp8.
        raise EvictionConfigError(
            f"--kv-cache-dtype {kv_cache_dtype} is not supported with {ours}: offload's host "
            f"tier and decode hold K/V in the model dtype; use --kv-cache-dtype auto with "
            f"offload, or fp8 with eviction alone (e.g. --kv-eviction h2o)")
    if async_scheduling:
        raise EvictionConfigError(
            f"--async-scheduling is not supported with {ours}: it schedules step t+1, "
            f"and plans its compactions, while step t still runs; drop --async-scheduling "
            f"(with eviction it is off by default)")


# Speculative methods eviction runs beside: drafts looked up in the request's
# own tokens. Every other method drafts with a model (EAGLE, MTP, a draft
# model, Medusa) whose layers read the target's KV or hidden states at
# positions compaction moves.
SPECULATION = ("ngram",)


class Speculation(NamedTuple):
    flag: str  # the vLLM flag that asked for it, for the message
    method: str | None  # None: not known before vLLM builds its config
    num_tokens: int | None  # draft tokens per step


def refuse_speculation(cfg: EvictionConfig, spec: Speculation | None, *, on_cpu: bool,
                       pipeline: int = 1, block_size: int | None = None) -> None:
    """Stop startup where speculative decoding cannot run beside eviction.
    Under eviction, a step writes its token and its drafts, and the drafts a
    step rejects are taken out of the scores before the next step reads them
    (integration/worker.py, _roll_back_drafts); the planner leaves room for
    the drafts in the budget's blocks (planner.compaction_target)."""
    if not cfg.enabled or spec is None:
        return
    ours, flag = _ours(cfg), spec.flag

    def refuse(why: str) -> None:
        raise EvictionConfigError(f"{flag} is not supported with {ours}: {why}")

    if cfg.offload:
        refuse(f"offload's host decode handles one new token per request per step; drop "
               f"{flag}, or use eviction without offload (e.g. --kv-eviction h2o)")
    if spec.method is not None and spec.method not in SPECULATION:
        refuse(f"method {spec.method!r} drafts with a model whose layers read the target's "
               f"KV cache, which eviction compacts; use method 'ngram' (prompt lookup) or "
               f"drop {flag}")
    if not on_cpu:
        refuse("speculative decoding beside eviction runs on the CPU backend only in this "
               "release (the CUDA backend scores each draft in its own step, rejected "
               "drafts included)")
    if pipeline > 1:
        refuse(f"--pipeline-parallel-size {pipeline}: a stage before the last learns which "
               f"drafts were accepted a step late, after its scores were read")
    if block_size and spec.num_tokens and spec.num_tokens > block_size - 2:
        refuse(f"num_speculative_tokens {spec.num_tokens} must leave a compaction room to "
               f"keep a token: at most {block_size - 2} at --block-size {block_size}")


def _speculation(engine_args) -> Speculation | None:
    """What the engine arguments asked of speculative decoding, if anything."""
    spec = engine_args.speculative_config
    if spec:
        method = spec.get("method")
        if method is None and spec.get("model"):
            method = "ngram" if spec["model"] in ("ngram", "[ngram]") else "draft_model"
        return Speculation("--speculative-config", method, spec.get("num_speculative_tokens"))
    for flag, key in (("--spec-method", "spec_method"), ("--spec-model", "spec_model"),
                      ("--spec-tokens", "spec_tokens")):
        if getattr(engine_args, key, None) is not None:
            method, model = getattr(engine_args, "spec_method", None), getattr(
                engine_args, "spec_model", None)
            if method is None and model is not None:  # as vLLM infers it
                method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
            return Speculation(flag, method, getattr(engine_args, "spec_tokens", None))
    return None


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def add_cli_args(parser, *args, **kwargs):
        parser = add_cli_args.__kvevict_original__.__func__(parser, *args, **kwargs)
        group = parser.add_argument_group(
            "KV eviction (vllm_kvevict)",
            "Keep only the KV cache each request needs; freed blocks go back to "
            "vLLM's block pool.")
        for flag in TABLE:  # core/config/flags.py: name, help, default and choices
            # SUPPRESS: an unset flag leaves additional_config alone, and --help
            # shows the real default from the text instead of "(default: None)".
            group.add_argument(flag.flag, dest=flag.key, default=argparse.SUPPRESS,
                               help=flag.help_text(),
                               **({"choices": flag.choices} if flag.choices else {}))
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
        from vllm.platforms import current_platform

        refuse_speculation(cfg, _speculation(self), on_cpu=current_platform.is_cpu(),
                           pipeline=self.pipeline_parallel_size)
        refuse_unsupported(cfg, pipeline=self.pipeline_parallel_size,
                           async_scheduling=self.async_scheduling,
                           kv_cache_dtype=str(self.kv_cache_dtype))
        if cfg.enabled:
            # None lets vLLM turn it on (CUDA); the user did not ask for it.
            self.async_scheduling = False
        if cfg.offload:
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
        if MODULE_ROUTES in os.environ.get("VLLM_PLUGINS", "").split(","):
            from vllm_kvevict.integration.prompt_modules import split_registry_problem

            split = split_registry_problem(self._api_process_count)
            if split:  # as vLLM refuses runtime LoRA updates with several API servers
                raise EvictionConfigError(split)
        select_attention_backend(self, cfg)
        vllm_config = create_engine_config.__kvevict_original__(self, *args, **kwargs)
        if cfg.enabled:
            cfg.check_block_size(vllm_config.cache_config.block_size)
            # Whatever set them (a platform hook, a model's own config): not with eviction.
            built, asked = vllm_config.speculative_config, _speculation(self)
            refuse_speculation(
                cfg, built and Speculation(asked.flag if asked else "--speculative-config",
                                           built.method, built.num_speculative_tokens),
                on_cpu=current_platform.is_cpu(),
                pipeline=vllm_config.parallel_config.pipeline_parallel_size,
                block_size=vllm_config.cache_config.block_size)
            refuse_unsupported(
                cfg, pipeline=vllm_config.parallel_config.pipeline_parallel_size,
                async_scheduling=vllm_config.scheduler_config.async_scheduling,
                kv_cache_dtype=str(vllm_config.cache_config.cache_dtype))
        if cfg.offload:  # before any worker: they load the file, never compute it
            from vllm_kvevict.integration.offload_attention import check_skewing

            check_skewing(vllm_config, cfg)
        return vllm_config

    mark_patched(EngineArgs, "add_cli_args", staticmethod(add_cli_args))
    mark_patched(EngineArgs, "from_cli_args", classmethod(from_cli_args))
    mark_patched(EngineArgs, "create_engine_config", create_engine_config)
