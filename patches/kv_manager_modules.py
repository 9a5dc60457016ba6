"""TARGET: vllm.v1.core.kv_cache_manager.KVCacheManager.get_computed_blocks / .free

WHY: prompt modules (Prompt Cache) reuse KV that is not a token prefix of the
     request: each module was encoded once at its schema positions. vLLM's
     prefix cache can only find blocks by a hash of the token prefix from
     position 0; the blocks must instead come from our ModuleStore.
HOW: get_computed_blocks: for a request whose layout imports modules, return
     the pinned blocks (and the tokens they hold) instead of a prefix-cache
     lookup; vLLM then adopts them exactly like prefix hits (touch, ref_cnt,
     free). free: before vLLM frees a finished module-encode request, the
     store takes a reference on its full blocks (integration/module_store.py;
     which blocks are pinned and which an importer gets is decided in
     core/eviction/blocks.py, tested with plain data).
UPSTREAM: a KV-manager hook "computed blocks for this request" (KV connectors
     get one for external tokens, not for local blocks), and a pin API on
     BlockPool.
"""

from __future__ import annotations

from . import mark_patched


def apply() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vllm_kvevict.integration.module_store import ModuleStore, layout_of

    def get_computed_blocks(self, request):
        if layout_of(request) is not None and self.prefix_cache_lookup_enabled(request):
            found = ModuleStore.of(self).computed_blocks(request)
            if found is not None:
                blocks, num_tokens = found
                return self.create_kv_cache_blocks(blocks), num_tokens, 0
            return self.empty_kv_cache_blocks, 0, 0  # never a prefix hit: positions differ
        return get_computed_blocks.__kvevict_original__(self, request)

    def free(self, request):
        if layout_of(request) is not None:
            ModuleStore.of(self).pin(request)
        return free.__kvevict_original__(self, request)

    mark_patched(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    mark_patched(KVCacheManager, "free", free)
