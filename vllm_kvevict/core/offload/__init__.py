"""InfiniGen offload: a worker's host entries (host_tier, the subsystem's map in
its docstring), their blocks (host_pool), the decode math (decode_attention),
and the skewing SVD with its file (skewing, skewing_store)."""
