"""The vLLM-free core: what to keep, how to move it, what to prefetch.

Nothing here imports vLLM or the tooling (`eval`, `calibrate`, `demo`,
`models`); tests/test_import_graph.py enforces it. Tensors in, tensors out:

  flags          every --kv-* setting declared once: key, flag, default, parser, help
  config         EvictionConfig: those settings, parsed and validated once
  policies       H2O, StreamingLLM, SnapKV, AnDPro: scores -> kept slots
  scores         H2O's accumulated attention, read from the paged cache
  window_scores  SnapKV / AnDPro scores of the last `window` queries
  decode_log     decode queries logged per step, scored in one batch
  query_window   the newest queries each request keeps for window scoring
  planner        when a request compacts and to what length (scheduler side)
  plans          the plan values the scheduler sends the workers
  compaction     moving kept tokens: fill_holes (O(evicted)); compact (reference)
  layout         the KVCacheLayout protocol; cpu_layout (ISA-packed CPU cache)
                 and nhd_layout (FlashAttention's [NB, BS, H, D]) implement it
  layer_stack    a worker's layer caches, stacked into one where vLLM allows
  kernel_dispatch  Triton kernel or plain-torch reference, per call
  pml, prompt_layout  prompt modules: the schema language and position ids
  host_tier      InfiniGen offload's state: a worker's host entries (the
                 subsystem's map is in its docstring); host_pool its blocks;
                 offload the decode math; skewing the SVD math and file
                 format; skewing_store where a server finds the file
  metrics        eviction counters shared with the API server's /metrics
"""
