"""Positions and tokens of PML schemas and prompts (Prompt Cache, sections 3.3-3.4).

Positions. A cursor walks the schema: text takes one position per token, a
`<param len=n>` reserves n positions, union members all start where the union
starts and the union is as long as its longest member. Each module is one
*unit* of encoding: its own text tokens at their positions (params and nested
modules leave gaps), attending only to itself. Top-level text forms anonymous
units (`#0`, `#1`, ...) that every prompt includes.

Parameters are not encoded with the module (the paper encodes `<unk>` fillers
there; we leave the positions empty instead, so no filler KV is ever read): a
prompt's parameter value is computed per request at those positions. Free text
in a prompt starts where the element before it ends (the paper's rule), text
before any import after the leading anonymous text.

Whitespace: text is tokenized as written, except that an edge run of
whitespace holding a newline becomes one newline (XML indentation costs no tokens).

Physical order. vLLM reads a request's KV from its block table in order, and
attention does not care about order, only positions. So a request's tokens
are laid out as [full blocks of each unit] + [private tokens: unit tails,
parameter values, free text], each with its schema position. The full blocks
are shared; everything private is computed by the request.

Cache salts. vLLM's prefix cache finds a block by its tokens and the
request's cache salt. A module request's blocks hold KV at schema positions,
so its salt must be one no client can send: an HMAC under a server secret,
in a namespace (SALT_PREFIX) that client salts may not use.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_kvevict.core.modules.pml import Import, Module, Param, PMLError, Prompt, Schema, Text, Union

Tokenize = Callable[[str], list[int]]

SALT_PREFIX = "kvevict:"  # module requests' cache salts; refused from clients
SALT_KEY_ENV = "KVEVICT_SALT_KEY"  # not VLLM_*: vLLM warns about unknown VLLM_ variables


def salt_key() -> bytes:
    """This server's secret for module cache salts. Made on first use and put
    into the environment, so that processes started later inherit it: the
    plugin loads (and calls this) in `vllm serve`'s main process before it
    spawns the API servers of `--api-server-count`, which compute the salts.
    Set it yourself to share it between hosts."""
    key = os.environ.get(SALT_KEY_ENV)
    if not key:
        key = os.environ[SALT_KEY_ENV] = secrets.token_hex(32)
    return key.encode()


def salt(*parts) -> str:
    """The cache salt of a module request described by `parts` (JSON values):
    the same parts give the same salt in every process sharing the key."""
    message = json.dumps(parts, separators=(",", ":")).encode()
    return SALT_PREFIX + hmac.new(salt_key(), message, hashlib.sha256).hexdigest()


@dataclass
class Unit:
    """One encoded span: a module, or anonymous top-level text."""

    name: str
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    params: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (start, len)
    parent: str | None = None
    union: int | None = None  # index of the union it belongs to (exclusive members)
    start: int = 0
    end: int = 0  # span end, nested modules and params included

    @property
    def anonymous(self) -> bool:
        return self.name.startswith("#")


def tenant(cache_salt: str | None) -> str:
    """The schema scope of a client's cache salt: "" (shared) without one,
    else a keyed digest (the salt itself is never stored or shown)."""
    return salt("tenant", cache_salt)[len(SALT_PREFIX):][:32] if cache_salt else ""


@dataclass
class SchemaLayout:
    name: str
    units: dict[str, Unit]  # schema order
    end: int  # one past the last position the schema uses
    scope: str = ""  # tenant(cache_salt) of the registering client; "" shared

    @property
    def ident(self) -> str:
        """The registry's name for it: `name`, or `name@scope` for a tenant's."""
        return f"{self.name}@{self.scope}" if self.scope else self.name

    def key(self, unit: str) -> str:
        """The engine-wide name of a unit's encoded blocks."""
        return f"{self.ident}/{unit}"

    def shared_blocks(self, block_size: int) -> int:
        """The KV blocks registering this schema pins (its units' full blocks)."""
        return sum(len(u.tokens) // block_size for u in self.units.values())

    def summary(self, block_size: int) -> dict:
        return {"name": self.name, "shared": not self.scope, "positions": self.end, "modules": [
            {"name": u.name, "parent": u.parent, "tokens": len(u.tokens),
             "positions": [u.start, u.end], "params": {k: v[1] for k, v in u.params.items()},
             "shared_tokens": len(u.tokens) // block_size * block_size}
            for u in self.units.values()]}


@dataclass
class RequestLayout:
    """What one PML prompt becomes. token_ids / positions are in physical order;
    `imports` are (unit key, tokens) of the shared full blocks that open it."""

    token_ids: list[int]
    positions: list[int]
    imports: list[tuple[str, int]]

    @property
    def num_shared(self) -> int:
        return sum(n for _, n in self.imports)


def normalize(text: str) -> str:
    """`text` with an edge run of whitespace holding a newline made one newline.
    Linear: str.lstrip/rstrip, never a backtracking regex (the regex
    `\\s*\\n\\s*$` is cubic in a run of newlines, which a client can send)."""
    body = text.lstrip()
    if "\n" in text[: len(text) - len(body)]:
        text = "\n" + body
    body = text.rstrip()
    if "\n" in text[len(body):]:
        text = body + "\n"
    return text


def _texts(parts):
    """Every Text of a schema's parts (walks at most pml.MAX_DEPTH deep)."""
    for part in parts:
        if isinstance(part, Text):
            yield part
        elif isinstance(part, (Module, Union)):
            yield from _texts(part.parts if isinstance(part, Module) else part.members)


def layout_schema(schema: Schema, tokenize: Tokenize, max_positions: int | None = None,
                  max_chars: int | None = None) -> SchemaLayout:
    """Raises PMLError, before tokenizing anything, when the schema's text is
    longer than `max_chars`, and stops as soon as it spans `max_positions`."""
    units: dict[str, Unit] = {}
    unions = 0
    if max_chars is not None:
        chars = sum(len(normalize(t.text)) for t in _texts(schema.parts))
        if chars > max_chars:
            raise PMLError(f"schema {schema.name!r} holds {chars} characters of text, more "
                           f"than fit in max_model_len ({max_chars} at most)")

    def grow(cursor: int) -> int:
        if max_positions is not None and cursor > max_positions:
            raise PMLError(f"schema {schema.name!r} spans more than {max_positions} "
                           f"positions (max_model_len)")
        return cursor

    def text(unit: Unit, t: Text, cursor: int) -> int:
        ids = tokenize(normalize(t.text))
        unit.tokens += ids
        unit.positions += range(cursor, cursor + len(ids))
        return grow(cursor + len(ids))

    def module(m: Module, cursor: int, parent: str | None, union: int | None) -> int:
        unit = units[m.name] = Unit(m.name, parent=parent, union=union, start=cursor)
        for part in m.parts:
            if isinstance(part, Text):
                cursor = text(unit, part, cursor)
            elif isinstance(part, Param):
                unit.params[part.name] = (cursor, part.length)
                cursor = grow(cursor + part.length)
            elif isinstance(part, Module):
                cursor = module(part, cursor, m.name, None)
            else:
                cursor = union_(part, cursor, m.name)
        unit.end = cursor
        return cursor

    def union_(u: Union, cursor: int, parent: str | None) -> int:
        nonlocal unions
        unions += 1
        index = unions  # a member's own nested unions bump the counter
        return max(module(m, cursor, parent, index) for m in u.members)

    cursor = 0
    for part in schema.parts:
        if isinstance(part, Text):
            unit = units[f"#{len(units)}"] = Unit(f"#{len(units)}", start=cursor)
            cursor = unit.end = text(unit, part, cursor)
        elif isinstance(part, Module):
            cursor = module(part, cursor, None, None)
        else:
            cursor = union_(part, cursor, None)
    return SchemaLayout(schema.name, units, cursor)


def layout_prompt(schema: SchemaLayout, prompt: Prompt, tokenize: Tokenize, block_size: int,
                  owner_of: Callable[[str], str | None] = lambda name: None,
                  around: tuple[str, str] = ("", "")) -> RequestLayout:
    """Resolve `prompt` against `schema`. `owner_of(name)` names another schema
    defining a module (for the error message). `around` is text before and
    after the <prompt> element (a chat template); when there is any, all
    request text flows after the schema's last position: before, the prompt's
    free text, after. Raises PMLError; nothing is changed."""
    if prompt.schema != schema.name:
        raise PMLError(f"prompt is for schema {prompt.schema!r}, not {schema.name!r}")
    chosen: list[Unit] = [u for u in schema.units.values() if u.anonymous]
    taken = {u.name for u in chosen}  # `unit in chosen` was quadratic
    private: list[tuple[list[int], list[int]]] = []  # (tokens, positions), prompt order
    unions: dict[int, str] = {}

    def pick(imp: Import, parent: str | None) -> Unit:
        unit = schema.units.get(imp.name)
        if unit is None or unit.anonymous:
            other = owner_of(imp.name)
            if other:
                raise PMLError(f"module {imp.name!r} belongs to schema {other!r}; a prompt "
                               f"cannot mix schemas (this one uses {schema.name!r})")
            raise PMLError(f"schema {schema.name!r} has no module {imp.name!r}")
        if unit.parent != parent:
            where = f"inside <{unit.parent}>" if unit.parent else "at the top level"
            raise PMLError(f"module {imp.name!r} is imported {where} in schema {schema.name!r}")
        if unit.name in taken:
            raise PMLError(f"module {imp.name!r} is imported twice")
        if unit.union is not None:
            if unit.union in unions:
                raise PMLError(f"modules {unions[unit.union]!r} and {imp.name!r} are members "
                               f"of one <union>: import at most one of them")
            unions[unit.union] = imp.name
        unknown = set(imp.args) - set(unit.params)
        if unknown:
            raise PMLError(f"module {imp.name!r} has no parameter {sorted(unknown)[0]!r}"
                           f" (it has: {', '.join(unit.params) or 'none'})")
        for name, value in imp.args.items():
            start, length = unit.params[name]
            ids = tokenize(value)
            if len(ids) > length:
                raise PMLError(f"parameter {name!r} of module {imp.name!r} is {len(ids)} "
                               f"tokens long; its len is {length}")
            private.append((ids, list(range(start, start + len(ids)))))
        chosen.append(unit)
        taken.add(unit.name)
        for child in imp.children:
            pick(child, imp.name)
        return unit

    def add_text(text: str, cursor: int) -> int:
        ids = tokenize(text) if text else []
        private.append((ids, list(range(cursor, cursor + len(ids)))))
        return cursor + len(ids)

    chat = any(around)
    cursor = add_text(around[0], schema.end) if chat else max(
        (u.end for u in chosen if u.start == 0), default=0)  # after leading anonymous text
    for part in prompt.parts:
        if isinstance(part, Text):
            cursor = add_text(normalize(part.text), cursor)
        elif chat:
            pick(part, None)
        else:  # text after an import follows the furthest module imported so far
            cursor = max(cursor, pick(part, None).end)
    add_text(around[1], cursor)

    token_ids: list[int] = []
    positions: list[int] = []
    imports: list[tuple[str, int]] = []
    tails = []
    for unit in sorted(chosen, key=lambda u: u.start):
        full = len(unit.tokens) // block_size * block_size
        if full:
            imports.append((schema.key(unit.name), full))
            token_ids += unit.tokens[:full]
            positions += unit.positions[:full]
        tails.append((unit.tokens[full:], unit.positions[full:]))
    for ids, pos in tails + private:
        token_ids += ids
        positions += pos
    if imports and sum(n for _, n in imports) == len(token_ids):
        # vLLM computes at least the last prompt token (it needs its logits).
        key, n = imports.pop()
        if n > block_size:
            imports.append((key, n - block_size))
    if not token_ids:
        raise PMLError("the prompt is empty")
    return RequestLayout(token_ids, positions, imports)
