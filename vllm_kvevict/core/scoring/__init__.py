"""The scores policies read. H2O: attention accumulated per slot while the
model runs (scores; decode_log and chunk_log batch it; private_scores for shared
first blocks). SnapKV/AnDPro: the newest queries (query_window) score every
resident token at compaction (window_scores)."""
