"""TARGET: vllm.renderers.params.TokenizeParams.apply_pre_tokenization

WHY: `truncate_prompt_tokens` (completions and chat) truncates the token ids
     vLLM makes of the prompt text; a PML prompt is then expanded from its
     text into module token ids (patches/input_processor_pml.py), so the
     truncation was silently lost: the whole prompt was sent. Truncating a
     module prompt has no meaning that keeps its modules whole (cutting
     shared blocks or positions would change what the modules are), so it is
     refused with a 400 that says why.
HOW: before vLLM tokenizes a text prompt, if truncation is asked for and the
     text holds a PML `<prompt schema=...>`, raise VLLMValidationError naming
     truncate_prompt_tokens. Every text prompt of the OpenAI routes and of
     LLM.generate is tokenized through this method.
UPSTREAM: a plugin hook for prompt rewriting in the renderer (then truncation
     could apply to the rewritten prompt, or the hook would refuse it).
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams

    from vllm_kvevict.core.modules.pml import OPEN_RE

    def apply_pre_tokenization(self, tokenizer, prompt):
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if (self.truncate_prompt_tokens is not None and isinstance(text, str)
                and OPEN_RE.search(text)):
            raise VLLMValidationError(
                "truncate_prompt_tokens cannot apply to a prompt-module (PML) prompt: its "
                "tokens are the modules' shared blocks at fixed positions, which truncation "
                "would cut; drop truncate_prompt_tokens, or import fewer modules",
                parameter="truncate_prompt_tokens", value=self.truncate_prompt_tokens)
        return apply_pre_tokenization.__kvevict_original__(self, tokenizer, prompt)

    mark_patched(TokenizeParams, "apply_pre_tokenization", apply_pre_tokenization)
