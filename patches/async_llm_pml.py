"""TARGET: vllm.v1.engine.async_llm.AsyncLLM.add_request

WHY: the OpenAI routes hand AsyncLLM a rendered prompt (a dict with "type"),
     and add_request calls InputProcessor.process_inputs on the event loop
     (vLLM: "no blocking preprocessing needed"). For a PML prompt that call
     parses, lays out and tokenizes modules (patches/input_processor_pml.py),
     which a hostile prompt can make take seconds, and the loop, /health with
     it, would wait (docs/prompt_modules.md). Expansion must run off the
     event loop.
HOW: when a rendered prompt's text holds `<prompt`, run
     prompt_modules.expand on the renderer's tokenizer thread (off_loop: the
     thread vLLM tokenizes on, so the tokenizer is never used by two threads
     at once) and hand the expanded prompt to the original; process_inputs
     sees this process's layout and does not expand it again. Bad PML raises
     VLLMValidationError (400), as in process_inputs.
UPSTREAM: prompt rewriting as an async renderer hook (vLLM renders text on
     its executor; a plugin hook there would need no patch).
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_kvevict.core.modules.pml import PMLError
    from vllm_kvevict.integration.prompt_modules import expand, off_loop

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        if (isinstance(params, SamplingParams) and isinstance(prompt, dict)
                and prompt.get("type") == "token" and isinstance(prompt.get("prompt"), str)
                and "<prompt" in prompt["prompt"]):
            try:
                prompt, params = await off_loop(self.input_processor, expand,
                                                self.input_processor, prompt, params)
            except PMLError as e:
                raise VLLMValidationError(
                    str(e), parameter=getattr(e, "parameter", "prompt")) from None
        return await add_request.__kvevict_original__(self, request_id, prompt, params,
                                                      *args, **kwargs)

    mark_patched(AsyncLLM, "add_request", add_request)
