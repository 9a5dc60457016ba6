"""Unit tests of the PML parser (`pml`) and of positions/tokens (`prompt_layout`).

No vLLM engine and no model: a fake tokenizer gives one token per
whitespace-separated word (ids from a dict), so every expected position below
is counted by hand. One test uses SmolLM2's real tokenizer when it is already
on disk (the `tokenizers` library alone, which loads in well under a second).
"""

from __future__ import annotations

import copy
import os

import pytest

from vllm_kvevict.core.modules.pml import (
    Import,
    Module,
    Param,
    PMLError,
    Prompt,
    Schema,
    Text,
    Union,
    find_prompt,
    parse_prompt,
    parse_schema,
)
from vllm_kvevict.core.modules.prompt_layout import (
    RequestLayout,
    SchemaLayout,
    layout_prompt,
    layout_schema,
    normalize,
)


class WordTok:
    """One token per whitespace-separated word; ids handed out on first sight."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, 1000 + len(self.vocab)) for w in text.split()]


class CharTok:
    """One token per character, whitespace included: shows what normalize() keeps."""

    def __call__(self, text: str) -> list[int]:
        return [ord(c) for c in text]


# Positions, counted by hand (one position per word):
#   #0     "You are a travel agent."            0..4                       end 5
#   plan   "Plan a trip of" 5..8, days (9, 3), "days." 12                  end 13
#   union  miami "Miami has sunny beaches."      13..16                    end 17
#          paris "Paris has many great museums." 13..17                    end 18
#   extra  "Extra" 18, inner "inner text" 19..20 (end 21), "tail" 21       end 22
#   #6     "Be concise."                         22..23                    end 24
TRIP = """
<schema name="trip">
  You are a travel agent.
  <module name="plan">Plan a trip of <param name="days" len="3"/> days.</module>
  <union>
    <module name="miami">Miami has sunny beaches.</module>
    <module name="paris">Paris has many great museums.</module>
  </union>
  <module name="extra">Extra <module name="inner">inner text</module> tail</module>
  Be concise.
</schema>
"""


@pytest.fixture
def tok():
    return WordTok()


@pytest.fixture
def trip(tok):
    return layout_schema(parse_schema(TRIP), tok)


def lay(schema: SchemaLayout, body: str, tok, block_size: int = 2, **kw) -> RequestLayout:
    return layout_prompt(schema, parse_prompt(f'<prompt schema="{schema.name}">{body}</prompt>'),
                         tok, block_size, **kw)


def ids(tok, text: str) -> list[int]:
    return tok(text)


def raises(match: str):
    return pytest.raises(PMLError, match=match)


# --------------------------------------------------------------------------- parse_schema


def test_parse_schema_structure():
    s = parse_schema(TRIP)
    assert s.name == "trip"
    kinds = [type(p) for p in s.parts]
    assert kinds == [Text, Module, Union, Module, Text]
    assert s.parts[0].text.strip() == "You are a travel agent."
    plan = s.parts[1]
    assert plan == Module("plan", (Text("Plan a trip of "), Param("days", 3), Text(" days.")))
    union = s.parts[2]
    assert [m.name for m in union.members] == ["miami", "paris"]
    extra = s.parts[3]
    assert extra.name == "extra"
    assert extra.parts == (Text("Extra "), Module("inner", (Text("inner text"),)), Text(" tail"))
    assert s.parts[4].text.strip() == "Be concise."


def test_parse_schema_drops_whitespace_only_text_and_comments():
    s = parse_schema('<schema name="s">\n  <!-- note -->\n  <module name="a">\n  x\n  </module>\n</schema>')
    assert s == Schema("s", (Module("a", (Text("\n  x\n  "),)),))


def test_pml_error_is_value_error():
    assert issubclass(PMLError, ValueError)


@pytest.mark.parametrize("source, message", [
    ("", "schema must be a non-empty PML string"),
    ("   \n ", "schema must be a non-empty PML string"),
    (None, "schema must be a non-empty PML string"),
    ('<schema name="s"><module name="a">x</schema>', "malformed PML schema: "),
    ("not xml at all", "malformed PML schema: "),
    ('<module name="a">x</module>', r"a schema starts with <schema name=\.\.\.>, got <module>"),
    ("<schema>x</schema>", r"<schema> needs a name attribute \(schema\)"),
    ('<schema name="  ">x</schema>', r"<schema> needs a name attribute \(schema\)"),
    ('<schema name="prompt">x</schema>', "schema name 'prompt' is reserved"),
    ('<schema name="1abc">x</schema>', "schema name '1abc' is not a valid XML tag name"),
    ('<schema name="s"><module>x</module></schema>', r"<module> needs a name attribute \(module\)"),
    ('<schema name="s"><module name="union">x</module></schema>', "module name 'union' is reserved"),
    ('<schema name="s"><module name="a b">x</module></schema>',
     "module name 'a b' is not a valid XML tag name"),
    ('<schema name="s"><module name="a"><param len="2"/></module></schema>',
     r"<param> needs a name attribute \(param\)"),
    ('<schema name="s"><module name="a"><param name="param" len="2"/></module></schema>',
     "param name 'param' is reserved"),
    # duplicate modules: siblings, nested, across union members
    ('<schema name="s"><module name="a">x</module><module name="a">y</module></schema>',
     "module 'a' is defined twice"),
    ('<schema name="s"><module name="a">x<module name="a">y</module></module></schema>',
     "module 'a' is defined twice"),
    ('<schema name="s"><module name="a">x</module><union><module name="a">y</module></union></schema>',
     "module 'a' is defined twice"),
    ('<schema name="s"><module name="a"><param name="p" len="1"/><param name="p" len="2"/></module></schema>',
     "module 'a': param 'p' is defined twice"),
    ('<schema name="s"><param name="p" len="2"/></schema>', "a <param> belongs inside a <module>"),
    ('<schema name="s"><module name="a"><param name="p"/></module></schema>',
     r"<param name='p'> needs len=<tokens>, got None"),
    ('<schema name="s"><module name="a"><param name="p" len="two"/></module></schema>',
     r"<param name='p'> needs len=<tokens>, got 'two'"),
    ('<schema name="s"><module name="a"><param name="p" len="0"/></module></schema>',
     r"<param name='p'>: len must be > 0, got 0"),
    ('<schema name="s"><module name="a"><param name="p" len="-3"/></module></schema>',
     r"<param name='p'>: len must be > 0, got -3"),
    ('<schema name="s"><module name="a"><param name="p" len="2">v</param></module></schema>',
     r"<param name='p'> must be empty"),
    ('<schema name="s"><module name="a"><param name="p" len="2"><b/></param></module></schema>',
     r"<param name='p'> must be empty"),
    ('<schema name="s"><union><module name="a">x</module><param name="p" len="1"/></union></schema>',
     r"a <union> holds only <module> elements"),
    ('<schema name="s"><union>loose text<module name="a">x</module></union></schema>',
     r"a <union> holds only <module> elements"),
    ('<schema name="s"><union><module name="a">x</module> tail text</union></schema>',
     r"a <union> holds only <module> elements"),
    ('<schema name="s"><union><union><module name="a">x</module></union></union></schema>',
     r"a <union> holds only <module> elements"),
    ('<schema name="s"><union></union></schema>', r"an empty <union>"),
    ('<schema name="s"><union>\n  \n</union></schema>', r"an empty <union>"),
    ('<schema name="s"><module name="a">x<union/></module></schema>', r"an empty <union>"),
    ('<schema name="s"><module name="a">x<b>y</b></module></schema>', r"module 'a': unexpected <b>"),
    ('<schema name="s"><foo/></schema>', r"schema 's': unexpected <foo>"),
    ('<schema name="s"/>', "schema 's' is empty"),
    ('<schema name="s">\n   \n</schema>', "schema 's' is empty"),
])
def test_parse_schema_errors(source, message):
    with raises(message):
        parse_schema(source)


# --------------------------------------------------------------------------- parse_prompt


def test_parse_prompt_structure():
    p = parse_prompt('<prompt schema="trip">Hi <plan days="3 &amp; 4"/><extra><inner/></extra>'
                     'Bye.</prompt>')
    assert p == Prompt("trip", (
        Text("Hi "),
        Import("plan", {"days": "3 & 4"}),
        Import("extra", {}, (Import("inner"),)),
        Text("Bye."),
    ))


def test_parse_prompt_self_closing_and_whitespace():
    assert parse_prompt('  <prompt schema=" trip "/>  ') == Prompt("trip", ())
    p = parse_prompt('<prompt schema="trip">\n  <plan/>\n  <miami/>\n</prompt>')
    assert p.parts == (Import("plan"), Import("miami"))


@pytest.mark.parametrize("source, message", [
    ("", "prompt must be a non-empty PML string"),
    (42, "prompt must be a non-empty PML string"),
    ('<prompt schema="trip"><plan></prompt>', "malformed PML prompt: "),
    ('<schema name="trip">x</schema>', r"a prompt starts with <prompt schema=\.\.\.>, got <schema>"),
    ("<prompt>x</prompt>", "<prompt> needs a schema attribute"),
    ('<prompt schema=" ">x</prompt>', "<prompt> needs a schema attribute"),
    ('<prompt schema="trip" name="x">x</prompt>', r"<prompt> takes only schema=, got \['name', 'schema'\]"),
    ('<prompt schema="trip"><plan>hello</plan></prompt>', "<plan>: free text goes outside module imports"),
    ('<prompt schema="trip"><extra><inner/>hi</extra></prompt>',
     "<extra>: free text goes outside module imports"),
    ('<prompt schema="trip"><extra><inner>deep</inner></extra></prompt>',
     "<inner>: free text goes outside module imports"),
    ('<prompt schema="trip"><module name="plan"/></prompt>', "<module> cannot appear inside a <prompt>"),
    ('<prompt schema="trip"><plan><param/></plan></prompt>', "<param> cannot appear inside a <prompt>"),
    ('<prompt schema="trip"><prompt schema="trip"/></prompt>', "<prompt> cannot appear inside a <prompt>"),
])
def test_parse_prompt_errors(source, message):
    with raises(message):
        parse_prompt(source)


# --------------------------------------------------------------------------- find_prompt


def test_find_prompt_none_without_prompt():
    assert find_prompt("Hello, <b>world</b>, no prompt <prompt> here") is None
    assert find_prompt("") is None


def test_find_prompt_in_chat_template():
    element = '<prompt schema="trip"><plan days="3"/>\n<miami/>Highlight surfing spots.</prompt>'
    before = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
    after = "<|im_end|>\n<|im_start|>assistant\n"
    assert find_prompt(before + element + after) == (before, element, after)
    # The element it finds parses.
    assert parse_prompt(find_prompt(before + element + after)[1]).schema == "trip"


def test_find_prompt_variants():
    assert find_prompt('<prompt schema="s"/>') == ("", '<prompt schema="s"/>', "")
    assert find_prompt('a <prompt  schema = "s" >x</prompt > b') == (
        "a ", '<prompt  schema = "s" >x</prompt >', " b")
    # Attribute containing a slash is not mistaken for a self-closing element.
    assert find_prompt('<prompt schema="a/b">x</prompt>!') == ("", '<prompt schema="a/b">x</prompt>', "!")


def test_find_prompt_errors():
    with raises(r"one <prompt> per request: a prompt cannot mix schemas"):
        find_prompt('<prompt schema="a"><x/></prompt> and <prompt schema="b"><y/></prompt>')
    with raises(r"one <prompt> per request"):
        find_prompt('<prompt schema="a"/><prompt schema="a"/>')
    with raises(r"malformed PML prompt: <prompt schema=\.\.\.> is never closed"):
        find_prompt('user: <prompt schema="a"><x/> and then nothing')


# --------------------------------------------------------------------------- normalize


@pytest.mark.parametrize("text, expected", [
    ("\n    Hello world\n  ", "\nHello world\n"),
    ("  \n \n   Hello", "\nHello"),
    ("Hello \n\n  ", "Hello\n"),
    ("\tHello\r\n\t", "\tHello\n"),           # leading run has no newline: kept
    ("  Hello  ", "  Hello  "),               # no newline at the edges: unchanged
    ("a\n   b\n\nc", "a\n   b\n\nc"),         # interior whitespace untouched
    ("Plan a trip of ", "Plan a trip of "),
    ("", ""),
])
def test_normalize(text, expected):
    assert normalize(text) == expected


def test_indentation_costs_no_tokens():
    """Indented and differently indented schemas give the same units, char by char."""
    deep = ('<schema name="s">\n            Hello.\n            <module name="a">\n'
            '                Hi there.\n            </module>\n</schema>')
    flat = '<schema name="s">\nHello.\n<module name="a">\nHi there.\n</module>\n</schema>'
    a, b = (layout_schema(parse_schema(x), CharTok()) for x in (deep, flat))
    assert [(u.name, u.tokens, u.positions) for u in a.units.values()] == \
           [(u.name, u.tokens, u.positions) for u in b.units.values()]
    assert a.units["#0"].tokens == [ord(c) for c in "\nHello.\n"]
    assert a.units["a"].tokens == [ord(c) for c in "\nHi there.\n"]
    assert a.units["a"].positions == list(range(8, 19))
    assert a.end == 19


# --------------------------------------------------------------------------- layout_schema


def test_layout_schema_positions(trip, tok):
    u = trip.units
    assert trip.name == "trip"
    assert list(u) == ["#0", "plan", "miami", "paris", "extra", "inner", "#6"]
    assert trip.end == 24

    assert u["#0"].anonymous and u["#6"].anonymous
    assert not any(u[n].anonymous for n in ("plan", "miami", "paris", "extra", "inner"))
    assert (u["#0"].start, u["#0"].end, u["#0"].positions) == (0, 5, [0, 1, 2, 3, 4])
    assert u["#0"].tokens == ids(tok, "You are a travel agent.")

    # Param: gap of len positions, not in the unit's tokens.
    assert (u["plan"].start, u["plan"].end) == (5, 13)
    assert u["plan"].params == {"days": (9, 3)}
    assert u["plan"].tokens == ids(tok, "Plan a trip of days.")
    assert u["plan"].positions == [5, 6, 7, 8, 12]

    # Union: members share the start; the union is as long as its longest member.
    for name, n in (("miami", 4), ("paris", 5)):
        assert u[name].start == 13
        assert u[name].end == 13 + n
        assert u[name].positions == list(range(13, 13 + n))
        assert u[name].parent is None
    assert u["miami"].union is not None and u["miami"].union == u["paris"].union
    assert u["plan"].union is None and u["extra"].union is None

    # Nested module: imported inside the parent; the parent's tokens exclude the child.
    assert (u["extra"].start, u["extra"].end) == (18, 22)   # after the longest member
    assert u["extra"].tokens == ids(tok, "Extra tail")
    assert u["extra"].positions == [18, 21]
    assert (u["inner"].start, u["inner"].end, u["inner"].parent) == (19, 21, "extra")
    assert u["inner"].tokens == ids(tok, "inner text")
    assert u["inner"].positions == [19, 20]

    assert (u["#6"].start, u["#6"].end, u["#6"].positions) == (22, 24, [22, 23])
    assert u["#6"].tokens == ids(tok, "Be concise.")


def test_layout_schema_union_and_params_inside_module(tok):
    s = layout_schema(parse_schema(
        '<schema name="s"><module name="m">M <param name="p" len="2"/>'
        '<union><module name="u1">a b c</module><module name="u2">d</module></union>'
        ' end <module name="k">k</module></module></schema>'), tok)
    u = s.units
    assert u["m"].tokens == ids(tok, "M end")
    assert u["m"].positions == [0, 6]
    assert u["m"].params == {"p": (1, 2)}
    assert (u["u1"].start, u["u1"].end, u["u1"].parent) == (3, 6, "m")
    assert (u["u2"].start, u["u2"].end, u["u2"].parent) == (3, 4, "m")
    assert u["u1"].union == u["u2"].union is not None
    assert (u["k"].start, u["k"].end, u["k"].parent, u["k"].union) == (7, 8, "m", None)
    assert (u["m"].start, u["m"].end) == (0, 8)
    assert s.end == 8


def test_layout_schema_module_of_only_params_and_children(tok):
    s = layout_schema(parse_schema(
        '<schema name="s"><module name="a"><param name="p" len="4"/><module name="b">x</module>'
        '</module></schema>'), tok)
    assert s.units["a"].tokens == [] and s.units["a"].positions == []
    assert s.units["a"].params == {"p": (0, 4)}
    assert (s.units["b"].start, s.units["b"].end) == (4, 5)
    assert s.end == 5


def test_anonymous_units_have_unique_names(tok):
    s = layout_schema(parse_schema(
        '<schema name="s">A <module name="a">x</module> B <module name="b">y</module> C</schema>'), tok)
    anon = [u for u in s.units.values() if u.anonymous]
    assert [u.tokens for u in anon] == [ids(tok, "A"), ids(tok, "B"), ids(tok, "C")]
    assert [u.positions for u in anon] == [[0], [2], [4]]
    assert len({u.name for u in anon}) == 3
    assert all(u.name.startswith("#") for u in anon)


def test_summary_and_key(trip):
    assert trip.key("plan") == "trip/plan"
    assert trip.key("#0") == "trip/#0"
    summary = trip.summary(block_size=4)
    assert summary["name"] == "trip" and summary["positions"] == 24
    mods = {m["name"]: m for m in summary["modules"]}
    assert mods["plan"] == {"name": "plan", "parent": None, "tokens": 5, "positions": [5, 13],
                            "params": {"days": 3}, "shared_tokens": 4}
    assert mods["inner"] == {"name": "inner", "parent": "extra", "tokens": 2, "positions": [19, 21],
                             "params": {}, "shared_tokens": 0}
    assert mods["paris"]["shared_tokens"] == 4 and mods["miami"]["shared_tokens"] == 4


# --------------------------------------------------------------------------- layout_prompt


def test_layout_prompt_physical_order(trip, tok):
    r = lay(trip, '<plan days="three"/><miami/>Highlight surfing spots.', tok, block_size=2)
    # Full blocks of each chosen unit in schema-position order (#0, plan, miami, #6) ...
    assert r.imports == [("trip/#0", 4), ("trip/plan", 4), ("trip/miami", 4), ("trip/#6", 2)]
    assert r.num_shared == 14
    assert all(n % 2 == 0 for _, n in r.imports)
    # ... then the private tails (#0 "agent.", plan "days."), the parameter value
    # at the param's positions, and the free text after the furthest import (miami, 17).
    assert r.token_ids == ids(tok, "You are a travel Plan a trip of Miami has sunny beaches. "
                                   "Be concise. agent. days. three Highlight surfing spots.")
    assert r.positions == [0, 1, 2, 3, 5, 6, 7, 8, 13, 14, 15, 16, 22, 23,
                           4, 12, 9, 17, 18, 19]
    assert len(r.token_ids) == len(r.positions) == 20


def test_layout_prompt_block_size_rounding(trip, tok):
    r = lay(trip, '<plan/><paris/>Go.', tok, block_size=4)
    # #0 has 5 tokens (4 shared), plan 5 (4), paris 5 (4), #6 2 (0).
    assert r.imports == [("trip/#0", 4), ("trip/plan", 4), ("trip/paris", 4)]
    assert r.token_ids == ids(tok, "You are a travel Plan a trip of Paris has many great "
                                   "agent. days. museums. Be concise. Go.")
    assert r.positions == [0, 1, 2, 3, 5, 6, 7, 8, 13, 14, 15, 16, 4, 12, 17, 22, 23, 18]
    r = lay(trip, '<plan/>', tok, block_size=8)
    assert r.imports == []
    assert r.num_shared == 0
    assert sorted(r.positions) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 22, 23]


def test_layout_prompt_nested_import(trip, tok):
    r = lay(trip, '<extra><inner/></extra>', tok, block_size=2)
    assert r.imports == [("trip/#0", 4), ("trip/extra", 2), ("trip/inner", 2), ("trip/#6", 2)]
    assert r.token_ids == ids(tok, "You are a travel Extra tail inner text Be concise. agent.")
    assert r.positions == [0, 1, 2, 3, 18, 21, 19, 20, 22, 23, 4]
    # The parent alone leaves the child's positions empty.
    r = lay(trip, '<extra/>', tok, block_size=2)
    assert 19 not in r.positions and 20 not in r.positions


def test_free_text_positions(trip, tok):
    # Before any import: right after the leading anonymous text.
    r = lay(trip, 'Hi <plan/>', tok, block_size=64)
    assert dict(zip(r.positions, r.token_ids))[5] == ids(tok, "Hi")[0]
    assert r.token_ids[-1] == ids(tok, "Hi")[0] and r.positions[-1] == 5
    # Between imports: where the element before it ends; then the furthest import so far.
    r = lay(trip, '<plan/>Now <miami/>go', tok, block_size=64)
    assert r.token_ids[-2:] == ids(tok, "Now go") and r.positions[-2:] == [13, 17]
    # After a far import then a near one: the furthest, not the last.
    r = lay(trip, '<extra/><plan/>after', tok, block_size=64)
    assert r.token_ids[-1:] == ids(tok, "after") and r.positions[-1:] == [22]
    # Text in the prompt is normalized (indentation costs nothing).
    r = lay(trip, '<plan/>\n      Hello there\n   ', tok, block_size=64)
    assert r.positions[-2:] == [13, 14]


def test_free_text_without_leading_anonymous_text(tok):
    s = layout_schema(parse_schema('<schema name="s"><module name="a">x y</module> Z</schema>'), tok)
    r = layout_prompt(s, parse_prompt('<prompt schema="s">first <a/> then</prompt>'), tok, 64)
    assert r.token_ids == ids(tok, "x y Z first then")
    assert r.positions == [0, 1, 2, 0, 2]


def test_chat_around_text_after_schema_end(trip, tok):
    around = ("<|user|> say:", "<|end|>")
    r = lay(trip, 'Pick <plan days="two"/><miami/>spots.', tok, block_size=2, around=around)
    assert r.imports == [("trip/#0", 4), ("trip/plan", 4), ("trip/miami", 4), ("trip/#6", 2)]
    private = r.token_ids[14:]
    assert private == ids(tok, "agent. days. <|user|> say: Pick two spots. <|end|>")
    # Before at schema.end (24), free text flows on regardless of imports, then after.
    assert r.positions[14:] == [4, 12, 24, 25, 26, 9, 27, 28]
    # Only the text after the element counts as chat too.
    r = lay(trip, '<plan/>', tok, block_size=64, around=("", "tail"))
    assert r.token_ids[-1:] == ids(tok, "tail") and r.positions[-1:] == [24]


def test_param_values(trip, tok):
    r = lay(trip, '<plan days="one two three"/>', tok, block_size=64)
    at = dict(zip(r.positions, r.token_ids))
    assert [at[p] for p in (9, 10, 11)] == ids(tok, "one two three")
    # A shorter value leaves the rest of the reserved positions empty.
    r = lay(trip, '<plan days="one"/>', tok, block_size=64)
    assert 9 in r.positions and 10 not in r.positions and 11 not in r.positions
    # No value: all reserved positions empty.
    r = lay(trip, '<plan/>', tok, block_size=64)
    assert not {9, 10, 11} & set(r.positions)
    # An empty value is allowed.
    r = lay(trip, '<plan days=""/>', tok, block_size=64)
    assert not {9, 10, 11} & set(r.positions)


def test_param_value_too_long(trip, tok):
    with raises(r"parameter 'days' of module 'plan' is 4 tokens long; its len is 3"):
        lay(trip, '<plan days="one two three four"/>', tok)


def test_last_block_never_shared(tok):
    s = layout_schema(parse_schema('<schema name="s"><module name="a">w1 w2 w3 w4</module>'
                                   '<module name="b">w5 w6</module></schema>'), tok)
    # Everything would be shared: the last block of the last unit is computed instead.
    r = layout_prompt(s, parse_prompt('<prompt schema="s"><a/></prompt>'), tok, 2)
    assert r.imports == [("s/a", 2)]
    assert r.token_ids == ids(tok, "w1 w2 w3 w4") and r.positions == [0, 1, 2, 3]
    assert r.num_shared == 2 < len(r.token_ids)
    r = layout_prompt(s, parse_prompt('<prompt schema="s"><a/><b/></prompt>'), tok, 2)
    assert r.imports == [("s/a", 4)]
    assert r.token_ids == ids(tok, "w1 w2 w3 w4 w5 w6") and r.positions == [0, 1, 2, 3, 4, 5]
    # A one-block unit: the import disappears altogether.
    r = layout_prompt(s, parse_prompt('<prompt schema="s"><a/></prompt>'), tok, 4)
    assert r.imports == [] and r.num_shared == 0 and len(r.token_ids) == 4
    # One private token is enough: nothing is given back.
    r = layout_prompt(s, parse_prompt('<prompt schema="s"><a/>q</prompt>'), tok, 2)
    assert r.imports == [("s/a", 4)] and r.num_shared == 4 and len(r.token_ids) == 5


def test_empty_prompt(tok):
    s = layout_schema(parse_schema(
        '<schema name="s"><module name="a"><param name="p" len="2"/></module></schema>'), tok)
    with raises("the prompt is empty"):
        layout_prompt(s, parse_prompt('<prompt schema="s"/>'), tok, 2)
    with raises("the prompt is empty"):
        layout_prompt(s, parse_prompt('<prompt schema="s"><a/></prompt>'), tok, 2)
    with raises("the prompt is empty"):
        layout_prompt(s, parse_prompt('<prompt schema="s"><a p=""/></prompt>'), tok, 2)
    r = layout_prompt(s, parse_prompt('<prompt schema="s"><a p="v"/></prompt>'), tok, 2)
    assert r.token_ids == ids(tok, "v") and r.positions == [0] and r.imports == []


def test_anonymous_text_always_included(trip, tok):
    r = lay(trip, 'Just text.', tok, block_size=64)
    assert r.token_ids == ids(tok, "You are a travel agent. Be concise. Just text.")
    assert r.positions == [0, 1, 2, 3, 4, 22, 23, 5, 6]


@pytest.mark.parametrize("body, message", [
    ("<nosuch/>", "schema 'trip' has no module 'nosuch'"),
    ("<miami/><paris/>", "modules 'miami' and 'paris' are members of one <union>: "
                         "import at most one of them"),
    ("<inner/>", r"module 'inner' is imported inside <extra> in schema 'trip'"),
    ("<extra><plan/></extra>", r"module 'plan' is imported at the top level in schema 'trip'"),
    ("<extra><paris/></extra>", r"module 'paris' is imported at the top level in schema 'trip'"),
    ("<plan/><plan/>", "module 'plan' is imported twice"),
    ("<miami/><miami/>", "module 'miami' is imported twice"),
    ("<extra><inner/><inner/></extra>", "module 'inner' is imported twice"),
    ('<plan weeks="2"/>', r"module 'plan' has no parameter 'weeks' \(it has: days\)"),
    ('<plan days="2" b="1" a="1"/>', r"module 'plan' has no parameter 'a' \(it has: days\)"),
    ('<miami x="1"/>', r"module 'miami' has no parameter 'x' \(it has: none\)"),
])
def test_layout_prompt_errors(trip, tok, body, message):
    before = copy.deepcopy(trip)
    with raises(message):
        lay(trip, body, tok)
    assert trip == before  # nothing is changed


def test_wrong_schema(trip, tok):
    with raises("prompt is for schema 'other', not 'trip'"):
        layout_prompt(trip, parse_prompt('<prompt schema="other"><plan/></prompt>'), tok, 2)


def test_module_of_another_schema(trip, tok):
    owners = {"rome": "italy"}
    with raises(r"module 'rome' belongs to schema 'italy'; a prompt cannot mix schemas "
                r"\(this one uses 'trip'\)"):
        lay(trip, "<plan/><rome/>", tok, owner_of=owners.get)
    # owner_of knows nothing: the plain unknown-module message.
    with raises("schema 'trip' has no module 'nosuch'"):
        lay(trip, "<nosuch/>", tok, owner_of=owners.get)


def test_anonymous_unit_cannot_be_imported(trip, tok):
    with raises("schema 'trip' has no module '#0'"):
        layout_prompt(trip, Prompt("trip", (Import("#0"),)), tok, 2)


def test_union_members_in_nested_union(tok):
    s = layout_schema(parse_schema(
        '<schema name="s"><module name="m">M<union><module name="u1">a</module>'
        '<module name="u2">b</module></union></module></schema>'), tok)
    r = layout_prompt(s, parse_prompt('<prompt schema="s"><m><u2/></m></prompt>'), tok, 64)
    assert r.token_ids == ids(tok, "M b") and r.positions == [0, 1]
    with raises("modules 'u1' and 'u2' are members of one <union>"):
        layout_prompt(s, parse_prompt('<prompt schema="s"><m><u1/><u2/></m></prompt>'), tok, 64)


NESTED_UNION = ('<schema name="s"><union>'
                '<module name="a">A <union><module name="x">X</module><module name="y">Y</module></union></module>'
                '<module name="b">B</module>'
                '</union></schema>')


def test_union_member_after_nested_union(tok):
    """A member after one holding a nested <union> keeps the outer union's index
    (found as a bug: the counter was read lazily inside a generator)."""
    s = layout_schema(parse_schema(NESTED_UNION), tok)
    u = s.units
    assert u["x"].union == u["y"].union
    assert u["a"].union == u["b"].union != u["x"].union
    with raises("modules 'a' and 'b' are members of one <union>"):
        layout_prompt(s, parse_prompt('<prompt schema="s"><a/><b/></prompt>'), tok, 2)


# --------------------------------------------------------------------------- real tokenizer


def _smollm2_tokenizer(model_path):
    import tokenizers

    tk = tokenizers.Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
    return lambda text: tk.encode(text, add_special_tokens=False).ids


def test_real_tokenizer_layout(model_path):
    tokenize = _smollm2_tokenizer(model_path)
    schema = layout_schema(parse_schema(TRIP), tokenize)
    u = schema.units
    plan_text = tokenize("Plan a trip of ") + tokenize(" days.")
    assert u["plan"].tokens == plan_text
    n_head = len(tokenize("Plan a trip of "))
    assert u["plan"].params == {"days": (u["plan"].start + n_head, 3)}
    assert u["miami"].start == u["paris"].start == u["plan"].end
    assert u["extra"].start == max(u["miami"].end, u["paris"].end)
    assert u["#0"].tokens == tokenize("\nYou are a travel agent.\n")

    bs = 4
    r = layout_prompt(schema, parse_prompt('<prompt schema="trip"><plan days="3"/><paris/>'
                                           'List two museums.</prompt>'), tokenize, bs)
    assert len(r.token_ids) == len(r.positions)
    assert all(n % bs == 0 and n > 0 for _, n in r.imports)
    assert 0 < r.num_shared < len(r.token_ids)
    assert [k for k, _ in r.imports] == [schema.key(n) for n in ("#0", "plan", "paris", "#6")
                                         if len(u[n].tokens) >= bs]
    # Shared blocks hold each unit's own tokens at its own positions.
    i = 0
    for key, n in r.imports:
        unit = u[key.split("/", 1)[1]]
        assert r.token_ids[i:i + n] == unit.tokens[:n]
        assert r.positions[i:i + n] == unit.positions[:n]
        i += n
    assert r.token_ids[-len(tokenize("List two museums.")):] == tokenize("List two museums.")
    days_start = u["plan"].params["days"][0]
    assert days_start in r.positions
