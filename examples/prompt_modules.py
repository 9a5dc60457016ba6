"""Prompt modules offline: two documents encoded once, imported in any order.

    python examples/prompt_modules.py [MODEL]
"""

import sys

from vllm import LLM, SamplingParams

from vllm_kvevict.integration import prompt_modules as pm

SCHEMA = """<schema name="people">You answer questions about the people described below.
<module name="alice">Alice lives in Paris, where she bakes bread every morning before the sun
rises. Her bakery is on a small street near the river, and her croissants are famous across
the city. On Sundays she teaches children how to knead dough.</module>
<module name="bob">Bob is a pilot who flies long routes between Tokyo and Sydney. He has a cat
named Miso and he collects old maps of the Pacific Ocean. He is <param name="age" len="6"/>
years old.</module>
</schema>"""


def main() -> None:
    from vllm_kvevict.models import ensure_smollm2

    model = sys.argv[1] if len(sys.argv) > 1 else ensure_smollm2()
    llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=2048,
              kv_cache_memory_bytes=256 << 20)
    print(pm.register_schema(llm, SCHEMA))
    # A PML prompt works as a completion prompt or, as here, inside a chat message.
    chats = [[{"role": "user", "content": '<prompt schema="people"><bob age="42"/><alice/>'
               'What is the name of the cat?</prompt>'}],
             [{"role": "user", "content": '<prompt schema="people"><alice/>'
               'Where does Alice live?</prompt>'}]]
    for out in llm.chat(chats, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False):
        print(f"{out.num_cached_tokens} of {len(out.prompt_token_ids)} prompt tokens reused:",
              repr(out.outputs[0].text))
    print("pinned:", pm.pinned_modules(llm))
    print("blocks released:", pm.remove_schema(llm, "people"))


if __name__ == "__main__":
    main()
