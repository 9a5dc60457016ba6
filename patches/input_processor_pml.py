"""TARGET: vllm.v1.engine.input_processor.InputProcessor.process_inputs
        and InputProcessor.assign_request_id

WHY: a prompt written in PML (`<prompt schema="s"><a/>text</prompt>`, alone
     or inside a chat message) must become the token ids and positions of its
     modules before vLLM validates lengths and builds the EngineCoreRequest.
     Both LLM.generate and the OpenAI routes end here, with the rendered text
     still beside its token ids. And whatever form a prompt takes (text, a
     dict, token ids, embeddings, a ready EngineCoreRequest), a layout this
     process did not make, or a cache salt in the module namespace, must be
     refused before the engine core.
HOW: integration/prompt_modules.expand() rewrites the prompt's token ids
     (physical order), sets a keyed cache salt and puts the layout into a
     clone of SamplingParams.extra_args; bad PML raises VLLMValidationError
     (400). prompt_modules.check_request() then checks the EngineCoreRequest
     the original built; assign_request_id, which LLMEngine and AsyncLLM call
     on every request, also those handed in ready-made, checks it again.
     apply() makes the salt key at plugin load, so that processes spawned
     later (API servers) inherit it.
UPSTREAM: a plugin hook for prompt rewriting in the renderer, and one for
     validating SamplingParams.extra_args on every request.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_kvevict.core.modules.pml import OPEN_RE, PMLError
    from vllm_kvevict.core.modules.prompt_layout import salt_key
    from vllm_kvevict.integration.prompt_modules import check_request, expand

    salt_key()  # in the main process, before it spawns API servers

    def refuse(e: PMLError):
        return VLLMValidationError(str(e), parameter=getattr(e, "parameter", "prompt"))

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        # Raw text (LLMEngine.add_request("...")) is rendered inside the
        # original; a PML one is expanded here instead, from its text.
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "type" not in prompt else None)
        if isinstance(text, str) and OPEN_RE.search(text):
            salted = isinstance(prompt, dict) and "cache_salt" in prompt  # a tenant's own
            prompt = {"type": "token", "prompt": text, "prompt_token_ids": [],
                      **({"cache_salt": prompt["cache_salt"]} if salted else {})}
        if isinstance(params, SamplingParams) and isinstance(prompt, dict):
            try:
                prompt, params = expand(self, prompt, params)
            except PMLError as e:
                raise refuse(e) from None
        request = process_inputs.__kvevict_original__(self, request_id, prompt, params,
                                                      *args, **kwargs)
        try:
            check_request(request, self.model_config.max_model_len)
        except PMLError as e:
            raise refuse(e) from None
        return request

    def assign_request_id(request):
        # Runs before the request reaches the output processor or the engine
        # core, on every path of LLMEngine/AsyncLLM.add_request. A static
        # method knows no max_model_len: the engine core checks that bound.
        try:
            check_request(request, None)
        except PMLError as e:
            raise refuse(e) from None
        return assign_request_id.__kvevict_original__(request)

    mark_patched(InputProcessor, "process_inputs", process_inputs)
    mark_patched(InputProcessor, "assign_request_id", staticmethod(assign_request_id))
