"""The thin layer that talks to vLLM 0.32: spec + block manager (scheduler side),
attention backend + compaction (worker side), and the plans that travel between.
Everything below it (vllm_kvevict.core) is vLLM-free."""
