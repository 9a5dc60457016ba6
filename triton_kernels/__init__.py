"""Triton kernels (scoring, compaction, partial attention) live here, shipped as
`vllm_kvevict.triton_kernels` so vLLM's probe for a top-level `triton_kernels`
module never picks them up. None exist yet: the CPU path is plain torch."""
