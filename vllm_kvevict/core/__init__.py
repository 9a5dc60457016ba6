"""The vLLM-free core: what to keep, how to move it, what to prefetch.

Nothing here imports vLLM or the tooling (`eval`, `calibrate`, `demo`,
`models`); tests/test_import_graph.py enforces it. Tensors in, tensors out.
One folder per subsystem:

  config/    flags: every --kv-* setting declared once (key, flag, default,
             parser, help); settings: EvictionConfig, parsed and validated once
  policies/  H2O, StreamingLLM, SnapKV, AnDPro: what each scores, and what stays
  scoring/   the scores policies read: H2O's accumulated attention (scores,
             decode_log, chunk_log, private_scores), SnapKV/AnDPro's window
             (query_window, window_scores)
  eviction/  when a request compacts and what happens to its blocks (planner,
             plans), moving kept tokens (compaction), and where the hot paths
             run (kernel_dispatch: Triton, the C++ CPU kernel or torch)
  layouts/   the paged cache's shapes: the KVCacheLayout protocol, the CPU
             backend's ISA-packed cache, FlashAttention's [NB, BS, H, D], and a
             worker's layers stacked into one tensor
  offload/   InfiniGen: host_tier (a worker's host entries), host_pool (their
             blocks), decode_attention (the paper's decode math), skewing (the
             SVD and its file), skewing_store (where a server finds the file)
  modules/   prompt modules: the PML schema language (pml), position ids and
             tenant scopes (prompt_layout), registered schemas (schema_registry)
"""
