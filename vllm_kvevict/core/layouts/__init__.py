"""The paged cache's shapes: the KVCacheLayout protocol (layout), the CPU
backend's ISA-packed cache (cpu_layout), FlashAttention's [NB, BS, H, D]
(nhd_layout), and a worker's layers stacked into one tensor (layer_stack)."""
