"""Engine core: prompt-module KV blocks, pinned in vLLM's own block pool.

A unit (module) is encoded by an ordinary request whose SamplingParams
.extra_args[LAYOUT_KEY] says `{"pin": key, "positions": [...]}`. When that
request finishes, before vLLM frees its blocks, `pin` takes one more reference
(`BlockPool.touch`) on its full blocks: they never return to the free queue
while the store holds them. A request whose layout lists `imports` gets those
blocks as its first blocks through the prefix-hit path of
`KVCacheManager.get_computed_blocks` (vLLM touches them again per request, so
`ref_cnt` = 1 + number of running importers), and frees them like any block.
`drop` releases the store's reference; blocks still read by running requests
return to the pool when those finish.

Nothing writes a shared block: its tokens are already computed, the request's
new tokens go to its own blocks, and eviction copies a kept shared block to a
private one first (core/eviction/blocks.py decides, spec.py applies). Which
blocks are pinned and which an importer gets are decided there too
(module_pin_blocks, module_imports, trim_hit); this file applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.request import RequestStatus

from vllm_kvevict.core.eviction.blocks import module_imports, module_pin_blocks, trim_hit

LAYOUT_KEY = "kvevict_layout"  # SamplingParams.extra_args key, set by prompt_modules


_LAYOUT_FIELDS = ("positions", "imports", "pin", "nonce")


def layout_of(request) -> dict | None:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    return extra.get(LAYOUT_KEY) if extra else None


def layout_problem(layout, prompt_token_ids, max_model_len: int | None) -> str | None:
    """Why `layout` cannot go with this prompt, or None. Asked at admission by
    the frontend and again by the engine core, since the scheduler, the KV
    manager and the runner read layouts unchecked: a malformed one must fail
    its own request there, never an engine step."""
    if not isinstance(layout, dict):
        return f"{LAYOUT_KEY} must be a dict, got {type(layout).__name__}"
    unknown = sorted(repr(k) for k in layout if k not in _LAYOUT_FIELDS)
    if unknown:
        return f"{LAYOUT_KEY}: unknown key {unknown[0]}"
    if prompt_token_ids is None:
        return f"{LAYOUT_KEY} needs the prompt's token ids (embeddings cannot import modules)"
    n, pos = len(prompt_token_ids), layout.get("positions")
    if (not isinstance(pos, (list, tuple)) or len(pos) != n
            or not all(type(p) is int for p in pos)):
        return f"{LAYOUT_KEY}: positions must list one position per prompt token ({n} integers)"
    if n and not (min(pos) >= 0 and (max_model_len is None or max(pos) < max_model_len)):
        return f"{LAYOUT_KEY}: positions must lie in [0, max_model_len={max_model_len})"
    imports = layout.get("imports", [])
    if not (isinstance(imports, (list, tuple)) and all(
            isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[0], str)
            and type(i[1]) is int and i[1] > 0 for i in imports)
            and sum(i[1] for i in imports) <= n):
        return f"{LAYOUT_KEY}: imports must be [module key, token count] pairs within the prompt"
    if not isinstance(layout.get("pin", ""), str):
        return f"{LAYOUT_KEY}: pin must be a module key (a string)"
    return None


def sharing_problem(groups) -> str | None:
    """Why modules cannot be shared on an engine with these KV cache group
    managers, or None. A module's blocks hold its KV for every layer from its
    first token; a hybrid model's sliding-window group keeps only a window of
    it (vLLM's manager frees the rest), so there is nothing whole to pin."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if len(groups) != 1 or not isinstance(groups[0], FullAttentionManager):
        return ("prompt modules need a model whose attention layers all attend to "
                "the whole context (one full-attention KV cache group); this model "
                "has sliding-window layers, which keep only their window's KV")
    return None


@dataclass
class Entry:
    tokens: tuple[int, ...]
    positions: tuple[int, ...]  # the schema positions its KV was computed at
    blocks: tuple[list, ...]  # per KV cache group, the pinned KVCacheBlocks


class ModuleStore:
    def __init__(self, kv_cache_manager) -> None:
        self.manager = kv_cache_manager
        self.entries: dict[str, Entry] = {}
        self.problem = sharing_problem(self._groups)  # the groups are the engine's for life

    @classmethod
    def of(cls, kv_cache_manager) -> "ModuleStore":
        store = getattr(kv_cache_manager, "_kvevict_modules", None)
        if store is None:
            store = kv_cache_manager._kvevict_modules = cls(kv_cache_manager)
        return store

    @property
    def _groups(self):
        return self.manager.coordinator.single_type_managers

    def pin(self, request) -> None:
        """Keep the full blocks of a finished encode request (before vLLM frees it)."""
        layout = layout_of(request)
        key = layout and layout.get("pin")
        if not key or key in self.entries or self.problem or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return  # aborted encodes pin nothing; a re-encode keeps the first copy
        groups = []
        for m in self._groups:
            keep = module_pin_blocks(request.num_computed_tokens, request.num_prompt_tokens,
                                     m.block_size)
            groups.append(list(m.req_to_blocks.get(request.request_id, [])[:keep]))
        if not groups or not groups[0]:
            return
        n = len(groups[0]) * self._groups[0].block_size
        for blocks in groups:
            self.manager.block_pool.touch(blocks)
        self.entries[key] = Entry(tuple(request.prompt_token_ids[:n]),
                                  tuple(layout["positions"][:n]), tuple(groups))

    def computed_blocks(self, request) -> tuple[tuple[list, ...], int] | None:
        """The pinned blocks opening `request`'s block table and the tokens they
        hold, or None when it imports nothing available. Each import's tokens
        and positions are checked against the pinned ones: a request can only
        ever read blocks that hold exactly its own tokens at its own positions."""
        layout = layout_of(request)
        imports = layout and layout.get("imports")
        if not imports or self.problem:
            return None
        bs = self._groups[0].block_size
        entries = {k: (e.tokens, e.positions) for k, e in self.entries.items()}
        taken, n, whole = module_imports(imports, request.prompt_token_ids,
                                         layout["positions"], entries, bs)
        out = [b for key, count in taken for b in self.entries[key].blocks[0][:count]]
        if whole:  # every import found: vLLM's prefix cache may extend the hit
            n, out = self._private_hits(request, n, out)
        n = trim_hit(n, request.num_tokens, bs)
        return ((out[: n // bs],), n) if n > 0 else None

    def _private_hits(self, request, n: int, out: list) -> tuple[int, list]:
        """Extend a complete module hit with vLLM's own prefix cache: the
        request's next full blocks (tails, parameters, free text) as an earlier
        request with the same layout left them. Safe because the request's
        cache salt hashes its positions and imports, so a block hash fixes the
        tokens, their positions and every module block they attended to. Only
        blocks that vLLM registered are found (none under h2o/snapkv/andpro)."""
        pool, group = self.manager.block_pool, self._groups[0]
        if pool.hash_block_size != group.block_size:
            return n, out
        hashes = request.block_hashes
        i = n // group.block_size
        while i < len(hashes):
            hit = pool.get_cached_block(hashes[i], [group.kv_cache_group_id])
            if hit is None:
                break
            out.append(hit[0])
            i += 1
        return i * group.block_size, out

    def drop(self, prefix: str) -> int:
        """Release the store's reference on every entry under `prefix`
        ("schema/"); returns the number of blocks released."""
        released = 0
        for key in [k for k in self.entries if k.startswith(prefix)]:
            entry = self.entries.pop(key)
            for blocks in entry.blocks:
                self.manager.block_pool.free_blocks(reversed(blocks))
                released += len(blocks)
        return released

    def usage(self) -> dict[str, int]:
        """Blocks the store pins (every group) and the pool's size, for the
        frontend's --kv-max-pinned check, and `problem`, checked before any
        schema is encoded."""
        pinned = sum(len(blocks) for e in self.entries.values() for blocks in e.blocks)
        return {"pinned_blocks": pinned, "pool_blocks": self.manager.block_pool.num_gpu_blocks,
                "problem": self.problem}

    def describe(self) -> dict[str, dict]:
        """key -> tokens, block ids and vLLM's ref_cnt of each pinned block."""
        return {k: {"tokens": len(e.tokens), "block_ids": [b.block_id for b in e.blocks[0]],
                    "ref_cnt": [b.ref_cnt for b in e.blocks[0]]}
                for k, e in self.entries.items()}
