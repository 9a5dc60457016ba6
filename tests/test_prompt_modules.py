"""Prompt modules on a real engine: positions, sharing, copy-on-write, bad input.

The reference is the Prompt Cache computation written densely in transformers:
each module's tokens attend only to their own module (encoded alone, at their
schema positions); every token the request computes attends to all tokens
before it in the request's physical order. Sharing and freeing are read from
vLLM's own BlockPool (ref_cnt, free queue), never from our counters.
"""

import pytest
import torch

from vllm_kvevict.core.modules.pml import parse_prompt
from vllm_kvevict.core.modules.prompt_layout import layout_prompt
from vllm_kvevict.integration import prompt_modules as pm
from vllm_kvevict.probe import scheduler_of

BS = 32
ALICE = ("Alice lives in Paris, where she bakes bread every morning before the sun rises. "
         "Her bakery is on a small street near the river, and her croissants are famous. ") * 2
BOB = ("Bob is a pilot who flies long routes between Tokyo and Sydney. He has a cat named "
       "Miso and he collects old maps of the Pacific Ocean. ") * 2
HEAD = "You answer questions about people.\n"  # the schema's anonymous text
BOB_BEFORE, AGE_LEN, BOB_AFTER = f"{BOB} He is ", 6, " years old."  # around bob's parameter
SCHEMA = f"""<schema name="people">{HEAD}<module name="alice">{ALICE}</module>
<module name="bob">{BOB_BEFORE}<param name="age" len="{AGE_LEN}"/>{BOB_AFTER}</module>
</schema>"""
AGE, QUESTION = "forty-two", "Question: who has a cat? Answer:"
PROMPT = f'<prompt schema="people"><bob age="{AGE}"/><alice/>{QUESTION}</prompt>'


@pytest.fixture(scope="module")
def llm(engines):
    yield engines.get(dtype="float32")  # float32: compared with the dense reference
    pm.REGISTRY.schemas.clear()


@pytest.fixture
def schema(llm):
    summary = pm.register_schema(llm, SCHEMA)
    yield summary
    if "people" in pm.REGISTRY.schemas:
        pm.remove_schema(llm, "people")


def read_kv(worker, layer: int, block_ids: list[int]):
    """(k, v) [H, N, D] of the tokens in `block_ids`, read from vLLM's paged cache."""
    from vllm_kvevict.integration.cpu_backend import layout_for_cache

    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    attn = ctx[f"model.layers.{layer}.self_attn.attn"]
    kv = attn.kv_cache
    layout = layout_for_cache(kv, attn.isa)
    heads, bs = kv.shape[1], kv.shape[2]
    slots = torch.tensor([b * bs + o for b in block_ids for o in range(bs)])
    k, v = layout.read_tokens(*layout.split(kv), (slots // bs).expand(heads, -1),
                              (slots % bs).expand(heads, -1))
    return k.float(), v.float()


def request_layout(llm, prompt: str):
    schema = pm.REGISTRY.schemas["people"]
    tok = llm.llm_engine.input_processor.tokenizer
    return schema, layout_prompt(schema, parse_prompt(prompt),
                                 lambda s: list(tok.encode(s, add_special_tokens=False)), BS)


def expected_layout(tok):
    """PROMPT's tokens, schema positions and attention segments, written here
    from SCHEMA by the rules of docs/prompt_modules.md, not by the plugin's
    `layout_prompt`: a cursor walks the schema (one position per token of each
    text piece, AGE_LEN reserved for the parameter; whitespace between elements
    is no text); each unit's (anonymous text, alice, bob) full blocks come first,
    in schema order, attending only to their own unit; then what the request
    computes, attending to everything before it: the units' tails, the
    parameter's value at the parameter's first positions, and the question,
    which starts where the furthest module imported before it (bob) ends.
    Returns ({unit: (tokens, positions)}, token ids, positions, segment ids:
    the unit's index for a shared token, -1 for a computed one)."""
    def enc(text):
        return tok(text, add_special_tokens=False).input_ids

    head, alice, before, after, age, question = map(enc, (HEAD, ALICE, BOB_BEFORE, BOB_AFTER,
                                                          AGE, QUESTION))
    p_alice = len(head)
    p_bob = p_alice + len(alice)
    p_age = p_bob + len(before)
    end = p_age + AGE_LEN + len(after)
    units = {"#0": (head, list(range(p_alice))),
             "alice": (alice, list(range(p_alice, p_bob))),
             "bob": (before + after, list(range(p_bob, p_age)) + list(range(p_age + AGE_LEN, end)))}
    ids, positions, segment, computed = [], [], [], []
    for i, (tokens, pos) in enumerate(units.values()):
        full = len(tokens) // BS * BS
        ids, positions, segment = ids + tokens[:full], positions + pos[:full], segment + [i] * full
        computed.append((tokens[full:], pos[full:]))
    computed += [(age, list(range(p_age, p_age + len(age)))),
                 (question, list(range(end, end + len(question))))]
    for tokens, pos in computed:
        ids, positions, segment = ids + tokens, positions + pos, segment + [-1] * len(tokens)
    return units, ids, positions, segment


def dense_reference(model, ids, positions, segment, n_new: int) -> list[int]:
    """Greedy tokens of the masked Prompt Cache computation. segment[i] >= 0: a
    shared module token (attends within its module only); -1: computed by the request."""
    ids, positions, segment = list(ids), list(positions), list(segment)
    out = []
    for _ in range(n_new):
        seg = torch.tensor(segment)
        n = len(ids)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal & ((seg[:, None] < 0) | (seg[:, None] == seg[None, :]))
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                           attention_mask=mask).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        ids.append(nxt)
        positions.append(max(positions) + 1)
        segment.append(-1)
    return out


def test_module_kv_and_first_tokens_match_dense_reference(llm, schema, hf):
    """The module KV in vLLM's pinned blocks and the first generated tokens
    equal transformers' computation of the layout `expected_layout` derives
    from the schema by hand; the plugin's own layout is only compared with it."""
    from vllm import SamplingParams

    model, tok = hf
    units, ids, positions, segment = expected_layout(tok)
    layout = request_layout(llm, PROMPT)[1]
    assert (layout.token_ids, layout.positions) == (ids, positions)
    pinned = pm.pinned_modules(llm)
    assert set(pinned) == {"people/alice", "people/bob"}
    # Module KV: vLLM's pinned blocks hold what the model computes for the
    # module's tokens alone, at the module's schema positions.
    last = model.config.num_hidden_layers - 1
    for key, entry in pinned.items():
        tokens, pos = units[key.split("/")[1]]
        n = entry["tokens"]
        assert n == len(tokens) // BS * BS > 0
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([tokens]),
                          position_ids=torch.tensor([pos]), use_cache=True).past_key_values
        for layer in (0, last):
            (k, v), = llm.collective_rpc(read_kv, args=(layer, entry["block_ids"]))
            ref_k, ref_v = cache.layers[layer].keys[0, :, :n], cache.layers[layer].values[0, :, :n]
            torch.testing.assert_close(k, ref_k, atol=2e-3, rtol=1e-3)
            torch.testing.assert_close(v, ref_v, atol=2e-3, rtol=1e-3)
    # First generated tokens: the same as the dense masked computation.
    ref = dense_reference(model, ids, positions, segment, 8)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == ids
    assert list(out.outputs[0].token_ids) == ref
    # The shared tokens really were reused, not recomputed.
    assert out.num_cached_tokens == sum(i >= 0 for i in segment) > 0


def _ref_counts(llm) -> dict[str, list[int]]:
    return {k: e["ref_cnt"] for k, e in pm.pinned_modules(llm).items()}


def test_concurrent_requests_hold_module_blocks_once_and_free_them(llm, schema):
    from vllm import SamplingParams

    engine = llm.llm_engine
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    pinned = pm.pinned_modules(llm)
    assert all(r == [1] * len(r) for r in _ref_counts(llm).values())  # the store's own pin
    n = 4
    questions = ["who bakes?", "who flies?", "where is the bakery?", "what is the cat called?"]
    for i, q in enumerate(questions):
        engine.add_request(str(9000 + i), f'<prompt schema="people"><alice/><bob/>{q}</prompt>',
                           SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    engine.step()  # all four admitted and prefilled together
    manager = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers[0]
    module_ids = pinned["people/alice"]["block_ids"] + pinned["people/bob"]["block_ids"]
    tables = [blocks for rid, blocks in manager.req_to_blocks.items() if rid.startswith("900")]
    assert len(tables) == n
    for blocks in tables:  # each table starts with the shared blocks
        assert [b.block_id for b in blocks[: len(module_ids)]] == module_ids
    assert all(r == [1 + n] * len(r) for r in _ref_counts(llm).values())
    # Removing the schema mid-flight drops only the store's reference.
    released = pm.remove_schema(llm, "people")
    assert released == len(module_ids)
    assert all(pool.blocks[b].ref_cnt == n for b in module_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert all(pool.blocks[b].ref_cnt == 0 for b in module_ids)
    assert pool.get_num_free_blocks() == free_before + len(module_ids)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all back, minus the null block


def test_a_plain_prompt_never_hits_module_blocks(llm, schema):
    """Module blocks hold KV at schema positions: a plain request with the same
    tokens must compute its own (prefix caching stays on)."""
    from vllm import SamplingParams

    unit = pm.REGISTRY.schemas["people"].units["alice"]
    out = llm.generate([{"prompt_token_ids": unit.tokens + [13]}],
                       SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0


def test_the_same_module_prompt_again_also_reuses_its_own_blocks(llm, schema):
    """An identical PML prompt sent again hits, after the module blocks, the
    full blocks the first one computed (tails, parameter values, free text)
    through vLLM's prefix cache, as APC does for an identical plain prompt,
    and generates the same tokens. A prompt with another parameter value
    reuses the modules and its full blocks before the first differing token."""
    from vllm import SamplingParams

    question = "Question: " + " ".join(f"does person {i} have a cat?" for i in range(12))
    make = lambda age: (f'<prompt schema="people"><bob age="{age}"/><alice/>'  # noqa: E731
                        f'{question} Answer:</prompt>')
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, second, other = (llm.generate([make(age)], params, use_tqdm=False)[0]
                            for age in ("forty-two", "forty-two", "thirty"))
    shared = request_layout(llm, make("forty-two"))[1].num_shared
    n = len(second.prompt_token_ids)
    assert n - shared > 2 * BS  # the request computes several full blocks itself
    assert first.num_cached_tokens == shared
    assert second.num_cached_tokens == (n - 1) // BS * BS  # all but the last token's block
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    ids, other_ids = (request_layout(llm, make(age))[1].token_ids for age in ("forty-two", "thirty"))
    diff = next(i for i, (a, b) in enumerate(zip(ids, other_ids)) if a != b)
    assert diff >= shared and other.num_cached_tokens == diff // BS * BS


@pytest.mark.parametrize("bad, message", [
    ('<prompt schema="people"><alice/>', "malformed PML"),
    ('<prompt schema="nobody"><alice/></prompt>', "no schema 'nobody'"),
    ('<prompt schema="people"><carol/></prompt>', "has no module 'carol'"),
    ('<prompt schema="people"><bob age="one two three four five six seven eight"/></prompt>',
     "its len is 6"),
    ('<prompt schema="people"><alice/></prompt> and <prompt schema="other"><x/></prompt>',
     "cannot mix schemas"),
])
def test_bad_prompts_are_refused_and_change_nothing(llm, schema, bad, message):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    pool = scheduler_of(llm).kv_cache_manager.block_pool
    free, refs = pool.get_num_free_blocks(), _ref_counts(llm)
    with pytest.raises(VLLMValidationError, match=message):
        llm.generate([bad], SamplingParams(max_tokens=4), use_tqdm=False)
    assert pool.get_num_free_blocks() == free and _ref_counts(llm) == refs
    good = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert good[0].num_cached_tokens > 0


def test_union_members_are_exclusive(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    pm.register_schema(llm, '<schema name="lang"><union><module name="en">Hello there.</module>'
                            '<module name="fr">Bonjour.</module></union></schema>')
    try:
        with pytest.raises(VLLMValidationError, match="members of one <union>"):
            llm.generate(['<prompt schema="lang"><en/><fr/>Hi</prompt>'],
                         SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        pm.remove_schema(llm, "lang")


def test_registration_errors(llm, schema):
    from vllm_kvevict.core.modules.pml import PMLError

    with pytest.raises(PMLError, match="already registered"):
        pm.register_schema(llm, SCHEMA)
    with pytest.raises(PMLError, match="malformed PML schema"):
        pm.register_schema(llm, "<schema name='x'><module name='a'>unclosed</schema>")
    with pytest.raises(KeyError, match="no schema 'ghost'"):
        pm.remove_schema(llm, "ghost")


def test_a_forged_layout_is_refused(llm, schema):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    forged = {"kvevict_layout": {"pin": "people/alice", "positions": [0, 1, 2]}}
    with pytest.raises(VLLMValidationError, match="internal to vllm_kvevict"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     SamplingParams(max_tokens=1, extra_args=forged), use_tqdm=False)


def test_positions_past_max_model_len_are_refused(llm, schema):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="max_model_len"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2000), use_tqdm=False)


def test_nested_modules_import_inside_their_parent(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    summary = pm.register_schema(llm, f'<schema name="trip"><module name="plan">{ALICE}'
                                      f'<module name="extra">{BOB}</module></module></schema>')
    shared = {m["name"]: m["shared_tokens"] for m in summary["modules"]}
    try:
        out = llm.generate(['<prompt schema="trip"><plan><extra/></plan>Summary:</prompt>'],
                           SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert shared["plan"] > 0 and shared["extra"] > 0
        assert out.num_cached_tokens == shared["plan"] + shared["extra"]
        with pytest.raises(VLLMValidationError, match="imported inside <plan>"):
            llm.generate(['<prompt schema="trip"><extra/></prompt>'],
                         SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        pm.remove_schema(llm, "trip")
