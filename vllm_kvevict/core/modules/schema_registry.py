"""Registered prompt-module schemas, per frontend process, per tenant.

Tenants: a schema registered with a client `cache_salt` belongs to
that salt's scope (prompt_layout.tenant: a keyed digest of the salt) and is
seen (listed, read, imported, removed) only by requests presenting the same
salt. A schema registered without a salt is shared: every request sees it,
salted or not. A tenant's own schema shadows a shared one of the same name.

`schemas` maps `SchemaLayout.ident` (`name`, or `name@scope`) to the layout;
every read takes a snapshot under the lock, so that worker threads (expansion
runs off the event loop) never iterate a dict being changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vllm_kvevict.core.modules.pml import PMLError
from vllm_kvevict.core.modules.prompt_layout import SchemaLayout


def ident(name: str, scope: str) -> str:
    return f"{name}@{scope}" if scope else name


class SchemaRegistry:
    def __init__(self) -> None:
        self.schemas: dict[str, SchemaLayout] = {}
        self.pending: set[str] = set()  # idents being encoded
        self.lock = threading.Lock()

    def reserve(self, key: str, admit: Callable[[int], None] | None = None) -> None:
        """Claim ident `key`; `admit(schemas registered or pending)` may refuse
        it (raises), under the same lock, so two registrations cannot both pass."""
        with self.lock:
            if key in self.schemas or key in self.pending:
                raise PMLError(f"schema {key.split('@')[0]!r} is already registered; "
                               f"remove it first")
            if admit is not None:
                admit(len(self.schemas) + len(self.pending))
            self.pending.add(key)

    def finish(self, layout: SchemaLayout, ok: bool) -> None:
        with self.lock:
            self.pending.discard(layout.ident)
            if ok:
                self.schemas[layout.ident] = layout

    def visible(self, scope: str) -> dict[str, SchemaLayout]:
        """name -> layout that a request of `scope` sees: shared, then its own."""
        with self.lock:
            shared = {k: s for k, s in self.schemas.items() if not s.scope}
            own = {s.name: s for s in self.schemas.values() if scope and s.scope == scope}
        return {**shared, **own}

    def get(self, name: str, scope: str) -> SchemaLayout | None:
        with self.lock:
            return self.schemas.get(ident(name, scope)) or self.schemas.get(name)

    def forget(self, name: str, scope: str) -> SchemaLayout:
        """Remove the schema `name` that `scope` sees (its own first); KeyError
        when it sees none."""
        with self.lock:
            for key in (ident(name, scope), name):
                if key in self.schemas:
                    return self.schemas.pop(key)
        raise KeyError(f"no schema {name!r} is registered")

    def owner_of(self, module: str, scope: str) -> str | None:
        """The visible schema defining `module` (for error messages only)."""
        return next((s.name for s in self.visible(scope).values() if module in s.units), None)
