"""Prompt Markup Language (Prompt Cache, section 3.2), parsed with a real XML parser.

A schema names reusable prompt modules; a prompt imports some of them:

    <schema name="trip">
      You are a travel agent.                      (anonymous: in every prompt)
      <module name="plan">Plan a trip of <param name="days" len="4"/> days.</module>
      <union>                                      (members share a start position)
        <module name="miami">Miami has beaches.</module>
        <module name="paris">Paris has museums.</module>
      </union>
    </schema>

    <prompt schema="trip"><plan days="3"/><miami/>Highlight surfing spots.</prompt>

Nested modules are imported inside their parent: `<a><b/></a>`. Everything here
is syntax; positions and tokens are `prompt_layout`'s job. Errors are PMLError
(a ValueError) with a message a user can act on; the server answers them 400.

Bounded: PML comes from clients, so parsing is linear in the input
and stops early. Expat reads the text once; a DTD (and so any entity
declaration: no entity is ever expanded) is refused at its first byte;
elements nested deeper than MAX_DEPTH, or more than `max_elements` of them,
stop the parse where they start, before any tree is built past the limit. The
recursive walks below are therefore at most MAX_DEPTH deep.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from xml.parsers import expat

RESERVED = {"schema", "module", "union", "param", "prompt"}
MAX_DEPTH = 64  # elements nested in one PML document, the root included


class PMLError(ValueError):
    """Malformed or inconsistent PML."""


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Param:
    name: str
    length: int  # positions reserved (the paper's `len`, in tokens)


@dataclass(frozen=True)
class Module:
    name: str
    parts: tuple = ()  # Text | Param | Module | Union, in document order


@dataclass(frozen=True)
class Union:
    members: tuple[Module, ...]


@dataclass(frozen=True)
class Schema:
    name: str
    parts: tuple = ()  # Text | Module | Union at top level


@dataclass(frozen=True)
class Import:
    """`<name p="v">...</name>` in a prompt: a module, its parameter values and
    the nested modules imported inside it."""

    name: str
    args: dict[str, str] = field(default_factory=dict)
    children: tuple["Import", ...] = ()


@dataclass(frozen=True)
class Prompt:
    schema: str
    parts: tuple = ()  # Text | Import, in document order


def _xml(source: str, what: str, max_elements: int | None = None) -> ET.Element:
    """The element tree of `source`, parsed by expat with the limits above."""
    if not isinstance(source, str) or not source.strip():
        raise PMLError(f"{what} must be a non-empty PML string")
    parser, builder = expat.ParserCreate(), ET.TreeBuilder()
    parser.buffer_text = True  # one data callback per text run
    depth = count = 0

    def start(tag, attrs):
        nonlocal depth, count
        depth, count = depth + 1, count + 1
        if depth > MAX_DEPTH:
            raise PMLError(f"PML {what} nests elements deeper than the depth limit "
                           f"({MAX_DEPTH})")
        if max_elements is not None and count > max_elements + 1:  # + the root
            raise PMLError(f"PML {what} has more than {max_elements} elements; "
                           f"--kv-max-modules is {max_elements}")
        builder.start(tag, attrs)

    def end(tag):
        nonlocal depth
        depth -= 1
        builder.end(tag)

    def dtd(*_):
        raise PMLError(f"PML {what}: DTDs and entity declarations are refused "
                       f"(<!DOCTYPE ...>, <!ENTITY ...>)")

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler = builder.data
    parser.StartDoctypeDeclHandler = parser.EntityDeclHandler = dtd
    try:
        parser.Parse(source.strip(), True)
    except expat.ExpatError as e:
        raise PMLError(f"malformed PML {what}: {e}") from None
    return builder.close()


def _name(el: ET.Element, what: str) -> str:
    name = (el.get("name") or "").strip()
    if not name:
        raise PMLError(f"<{el.tag}> needs a name attribute ({what})")
    if name in RESERVED:
        raise PMLError(f"{what} name {name!r} is reserved")
    if not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
        raise PMLError(f"{what} name {name!r} is not a valid XML tag name")
    return name


def _texts_and_children(el: ET.Element):
    """(Text | child element) in document order; whitespace-only text dropped."""
    if el.text and el.text.strip():
        yield Text(el.text)
    for child in el:
        yield child
        if child.tail and child.tail.strip():
            yield Text(child.tail)


def _param(el: ET.Element) -> Param:
    name = _name(el, "param")
    raw = el.get("len")
    try:
        length = int(raw)
    except (TypeError, ValueError):
        raise PMLError(f"<param name={name!r}> needs len=<tokens>, got {raw!r}") from None
    if length <= 0:
        raise PMLError(f"<param name={name!r}>: len must be > 0, got {length}")
    if len(el) or (el.text and el.text.strip()):
        raise PMLError(f"<param name={name!r}> must be empty")
    return Param(name, length)


def _union(el: ET.Element, names: set[str]) -> Union:
    members = []
    for part in _texts_and_children(el):
        if isinstance(part, Text) or part.tag != "module":
            raise PMLError("a <union> holds only <module> elements")
        members.append(_module(part, names))
    if not members:
        raise PMLError("an empty <union>")
    return Union(tuple(members))


def _module(el: ET.Element, names: set[str]) -> Module:
    name = _name(el, "module")
    if name in names:
        raise PMLError(f"module {name!r} is defined twice")
    names.add(name)
    parts, params = [], set()
    for part in _texts_and_children(el):
        if isinstance(part, Text):
            parts.append(part)
        elif part.tag == "param":
            p = _param(part)
            if p.name in params:
                raise PMLError(f"module {name!r}: param {p.name!r} is defined twice")
            params.add(p.name)
            parts.append(p)
        elif part.tag == "module":
            parts.append(_module(part, names))
        elif part.tag == "union":
            parts.append(_union(part, names))
        else:
            raise PMLError(f"module {name!r}: unexpected <{part.tag}>")
    return Module(name, tuple(parts))


def parse_schema(source: str, max_elements: int | None = None) -> Schema:
    """`max_elements`: most <module>, <union> and <param> elements (None: no cap)."""
    root = _xml(source, "schema", max_elements)
    if root.tag != "schema":
        raise PMLError(f"a schema starts with <schema name=...>, got <{root.tag}>")
    name = _name(root, "schema")
    names: set[str] = set()
    parts = []
    for part in _texts_and_children(root):
        if isinstance(part, Text):
            parts.append(part)
        elif part.tag == "module":
            parts.append(_module(part, names))
        elif part.tag == "union":
            parts.append(_union(part, names))
        elif part.tag == "param":
            raise PMLError("a <param> belongs inside a <module>")
        else:
            raise PMLError(f"schema {name!r}: unexpected <{part.tag}>")
    if not parts:
        raise PMLError(f"schema {name!r} is empty")
    return Schema(name, tuple(parts))


def _import(el: ET.Element) -> Import:
    if el.tag in RESERVED:
        raise PMLError(f"<{el.tag}> cannot appear inside a <prompt>")
    children = []
    for part in _texts_and_children(el):
        if isinstance(part, Text):
            raise PMLError(f"<{el.tag}>: free text goes outside module imports")
        children.append(_import(part))
    return Import(el.tag, dict(el.attrib), tuple(children))


def parse_prompt(source: str, max_elements: int | None = None) -> Prompt:
    """`max_elements`: most imports (None: no cap)."""
    root = _xml(source, "prompt", max_elements)
    if root.tag != "prompt":
        raise PMLError(f"a prompt starts with <prompt schema=...>, got <{root.tag}>")
    schema = (root.get("schema") or "").strip()
    if not schema:
        raise PMLError("<prompt> needs a schema attribute")
    if set(root.attrib) - {"schema"}:
        raise PMLError(f"<prompt> takes only schema=, got {sorted(root.attrib)}")
    parts = tuple(p if isinstance(p, Text) else _import(p) for p in _texts_and_children(root))
    return Prompt(schema, parts)


OPEN_RE = re.compile(r"<prompt\s+schema\s*=")
ELEMENT_RE = re.compile(r"<prompt\s+schema\s*=[^>]*?/>|<prompt\s+schema\s*=.*?</prompt\s*>", re.DOTALL)


def find_prompt(text: str) -> tuple[str, str, str] | None:
    """Split `text` into (before, <prompt schema=...>...</prompt>, after), or None
    when it holds no PML prompt. Chat templates wrap the user's message, so the
    element may sit anywhere in the rendered text."""
    opened = len(OPEN_RE.findall(text))
    if not opened:
        return None
    if opened > 1:
        raise PMLError("one <prompt> per request: a prompt cannot mix schemas")
    m = ELEMENT_RE.search(text)
    if m is None:
        raise PMLError("malformed PML prompt: <prompt schema=...> is never closed")
    return text[: m.start()], m.group(0), text[m.end():]
