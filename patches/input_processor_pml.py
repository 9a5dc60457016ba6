"""TARGET: vllm.v1.engine.input_processor.InputProcessor.process_inputs

WHY: a prompt written in PML (`<prompt schema="s"><a/>text</prompt>`, alone
     or inside a chat message) must become the token ids and positions of its
     modules before vLLM validates lengths and builds the EngineCoreRequest.
     Both LLM.generate and the OpenAI routes end here, with the rendered text
     still beside its token ids.
HOW: integration/prompt_modules.expand() rewrites the prompt's token ids
     (physical order), sets a cache salt and puts the layout into a clone of
     SamplingParams.extra_args; bad PML raises VLLMValidationError (400).
     Layouts this process did not make are refused.
UPSTREAM: a plugin hook for prompt rewriting in the renderer.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_kvevict.integration.prompt_modules import check_layout, expand
    from vllm_kvevict.pml import OPEN_RE, PMLError

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        # Raw text (LLMEngine.add_request("...")) is rendered inside the
        # original; a PML one is expanded here instead, from its text.
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "type" not in prompt else None)
        if isinstance(text, str) and OPEN_RE.search(text):
            prompt = {"type": "token", "prompt": text, "prompt_token_ids": []}
        if isinstance(params, SamplingParams) and isinstance(prompt, dict):
            try:
                prompt, params = expand(self, prompt, params)
                if "prompt_token_ids" in prompt:
                    check_layout(params, len(prompt["prompt_token_ids"]),
                                 self.model_config.max_model_len)
            except PMLError as e:
                raise VLLMValidationError(str(e), parameter="prompt") from None
        return process_inputs.__kvevict_original__(self, request_id, prompt, params,
                                                   *args, **kwargs)

    mark_patched(InputProcessor, "process_inputs", process_inputs)
