"""PML from a hostile client (issue 38), without vLLM: parsing and layout are
linear in the input and bounded (depth, element count, text length), DTDs are
refused, and schemas are scoped per tenant (core/modules/schema_registry.py).

The server-level probes of the same inputs (with /health polled while they
run) are in test_prompt_modules_server.py.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap

import pytest

from vllm_kvevict.core.modules.pml import MAX_DEPTH, PMLError, parse_prompt, parse_schema
from vllm_kvevict.core.modules.prompt_layout import layout_prompt, layout_schema, normalize, tenant
from vllm_kvevict.core.modules.schema_registry import SchemaRegistry


def _words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


def old_normalize(text: str) -> str:  # the regex of before issue 38: cubic, kept as the spec
    return re.sub(r"\s*\n\s*$", "\n", re.sub(r"^\s*\n\s*", "\n", text))


def test_normalize_keeps_its_meaning():
    """The linear normalize() gives what the regex gave, on short random texts."""
    rng = random.Random(38)
    alphabet = ["\n", " ", "\t", "\r", "\u00a0", "\u2028", "\x0b", "a", "b"]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert normalize(text) == old_normalize(text), repr(text)


def test_100k_newlines_parse_and_lay_out_in_linear_time():
    """`'a' + '\\n' * n + 'b'` took 6.9 s at n = 1,500 with the old regex, growing
    as n**3: n = 100,000 would take weeks. Here: schema and prompt, parsed, laid out
    and normalized, in a child process killed after 60 s (measured: well under 1 s)."""
    code = textwrap.dedent("""
        import time
        from vllm_kvevict.core.modules.pml import parse_prompt, parse_schema
        from vllm_kvevict.core.modules.prompt_layout import layout_prompt, layout_schema, normalize
        body = "a" + "\\n" * 100_000 + "b"
        start = time.perf_counter()
        tok = lambda text: [len(w) for w in text.split()]
        schema = layout_schema(parse_schema(f'<schema name="ws">{body}<module name="m">'
                                            f'{body}</module>{body}</schema>'), tok)
        layout_prompt(schema, parse_prompt(f'<prompt schema="ws"><m/>{body}</prompt>'), tok, 4)
        assert normalize("\\n" * 100_000 + "x" + " \\n" * 100_000) == "\\nx\\n"
        print(time.perf_counter() - start)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 10, out.stdout


BILLION_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
                  '<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>'
                  '<schema name="s">&lol2;</schema>')


@pytest.mark.parametrize("source", [
    BILLION_LAUGHS,
    '<!DOCTYPE schema SYSTEM "file:///etc/passwd"><schema name="s">x</schema>',
    '<!DOCTYPE schema [<!ENTITY x SYSTEM "file:///etc/passwd">]><schema name="s">&x;</schema>',
    '<!DOCTYPE schema><schema name="s">x</schema>',
])
def test_dtds_and_entity_declarations_are_refused(source):
    with pytest.raises(PMLError, match="DTDs and entity declarations are refused"):
        parse_schema(source)
    with pytest.raises(PMLError, match="DTDs"):
        parse_prompt(source.replace("<schema", "<prompt").replace("</schema>", "</prompt>")
                     .replace('name="s"', 'schema="s"'))


def nested_modules(depth: int) -> str:
    return ('<schema name="deep">' + "".join(f'<module name="m{i}">t' for i in range(depth))
            + "</module>" * depth + "</schema>")


def nested_unions(depth: int) -> str:
    return ('<schema name="deep">' + "".join(f'<union><module name="u{i}">t'
                                             for i in range(depth))
            + "</module></union>" * depth + "</schema>")


@pytest.mark.parametrize("source", [nested_modules(3000), nested_unions(1500),
                                    nested_modules(MAX_DEPTH)])
def test_nesting_past_the_depth_limit_is_refused_naming_it(source):
    """3,000 modules or 1,500 unions deep were a RecursionError (a 500)."""
    with pytest.raises(PMLError, match=rf"deeper than the depth limit \({MAX_DEPTH}\)"):
        parse_schema(source)


def test_nesting_up_to_the_depth_limit_lays_out():
    schema = layout_schema(parse_schema(nested_modules(MAX_DEPTH - 1)), _words)
    assert len(schema.units) == MAX_DEPTH - 1
    imports = "".join(f"<m{i}>" for i in range(5)) + "".join(f"</m{i}>" for i in
                                                             reversed(range(5)))
    assert layout_prompt(schema, parse_prompt(f'<prompt schema="deep">{imports}</prompt>'),
                         _words, 2).token_ids
    deep = "".join(f"<m{i}>" for i in range(3000)) + "</x>"
    with pytest.raises(PMLError, match="depth limit"):
        parse_prompt(f'<prompt schema="deep">{deep}</prompt>')


def test_the_element_cap_stops_a_wide_union_while_parsing():
    """A union of 20,000 one-token members was accepted (GET returned 1.8 MB)."""
    wide = ('<schema name="wide"><union>' + "".join(f'<module name="m{i}">x</module>'
                                                   for i in range(20_000))
            + "</union></schema>")
    with pytest.raises(PMLError, match="more than 512 elements; --kv-max-modules is 512"):
        parse_schema(wide, max_elements=512)
    assert len(parse_schema(wide).parts[0].members) == 20_000  # offline: no cap
    ok = '<schema name="s"><union><module name="a">x</module></union></schema>'
    assert parse_schema(ok, max_elements=2)  # union + module: at the cap
    with pytest.raises(PMLError, match="--kv-max-modules is 1"):
        parse_schema(ok, max_elements=1)
    imports = "".join(f"<m{i}/>" for i in range(600))
    with pytest.raises(PMLError, match="--kv-max-modules is 512"):
        parse_prompt(f'<prompt schema="wide">{imports}</prompt>', max_elements=512)


def test_text_past_max_model_len_is_refused_before_tokenizing():
    calls = []

    def tok(text):
        calls.append(text)
        return _words(text)

    schema = parse_schema('<schema name="s">' + "word " * 1000 + "</schema>")
    with pytest.raises(PMLError, match="5000 characters of text, more than fit"):
        layout_schema(schema, tok, max_chars=4999)
    assert calls == []  # nothing tokenized
    with pytest.raises(PMLError, match="spans more than 99 positions"):
        layout_schema(schema, tok, max_positions=99)
    many = parse_schema('<schema name="s">' + "".join(f'<module name="m{i}">a b</module>'
                                                      for i in range(100)) + "</schema>")
    calls.clear()
    with pytest.raises(PMLError, match="spans more than 9 positions"):
        layout_schema(many, tok, max_positions=9)
    assert len(calls) == 5  # stops as soon as it passes, not after every module
    with pytest.raises(PMLError, match="spans more than"):  # a param's len counts too
        layout_schema(parse_schema('<schema name="s"><module name="m"><param name="p" '
                                   'len="1000000000"/></module></schema>'), tok,
                      max_positions=2047)


# --- tenants --------------------------------------------------------------------------

def registered(reg: SchemaRegistry, name: str, salt: str | None):
    layout = layout_schema(parse_schema(f'<schema name="{name}"><module name="m_{name}">'
                                        f'{salt or "shared"} text</module></schema>'), _words)
    layout.scope = tenant(salt)
    reg.reserve(layout.ident)
    reg.finish(layout, True)
    return layout


def test_a_salted_schema_is_seen_only_with_its_salt():
    reg = SchemaRegistry()
    shared = registered(reg, "docs", None)
    a = registered(reg, "mine", "tenant-a")
    a_docs = registered(reg, "docs", "tenant-a")  # its own, shadowing the shared one
    b = tenant("tenant-b")
    assert set(reg.visible("")) == {"docs"} and reg.visible("")["docs"] is shared
    assert set(reg.visible(b)) == {"docs"} and reg.visible(b)["docs"] is shared
    assert reg.visible(tenant("tenant-a")) == {"docs": a_docs, "mine": a}
    assert reg.get("mine", "") is None and reg.get("mine", b) is None
    assert reg.get("mine", tenant("tenant-a")) is a
    assert reg.owner_of("m_mine", b) is None and reg.owner_of("m_mine", a.scope) == "mine"
    with pytest.raises(KeyError):
        reg.forget("mine", b)
    with pytest.raises(KeyError):
        reg.forget("mine", "")
    assert reg.forget("mine", a.scope) is a and reg.forget("docs", a.scope) is a_docs
    assert reg.forget("docs", b) is shared  # a shared schema is everyone's
    assert reg.schemas == {}
    assert tenant("tenant-a") != tenant("tenant-b") and "tenant" not in tenant("tenant-a")
    assert a.key("m_mine") != registered(reg, "mine", "tenant-b").key("m_mine")
