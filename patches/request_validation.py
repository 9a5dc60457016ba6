"""TARGET: vllm.v1.engine.input_processor.InputProcessor._validate_params

WHY: a request may set its own `kv_budget` / `kv_recent` (SamplingParams
     .extra_args; `vllm_xargs` in the OpenAI API). A bad value must be refused
     at admission with a 400 that names the field, before the request reaches
     the engine core, where an error would abort the whole engine.
HOW: after the stock checks, parse the request's kv_* keys against the
     server's eviction settings (EvictionConfig.for_request) and re-raise a
     failure as VLLMValidationError, which the OpenAI server answers with 400
     and LLM.generate raises.
UPSTREAM: a plugin hook for validating SamplingParams.extra_args (today only
     custom logits processors get `validate_params`).
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_kvevict.core.config.settings import EvictionConfigError
    from vllm_kvevict.integration.settings import eviction_config

    def _validate_params(self, params, *args, **kwargs):
        result = _validate_params.__kvevict_original__(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            server = eviction_config(self.vllm_config)
            try:
                server.for_request(params.extra_args, self.cache_config.block_size)
            except EvictionConfigError as e:
                raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
        return result

    mark_patched(InputProcessor, "_validate_params", _validate_params)
