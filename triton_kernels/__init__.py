"""Triton kernels for the plugin's CUDA path, shipped as `vllm_kvevict.triton_kernels`
(vLLM probes for a top-level `triton_kernels` module, so this folder never is one).

  module             kernel                                     the CPU path it mirrors
  paged_attention    decode attention over the NHD paged cache  core/scores.py (H2O)
                     that also adds H2O scores per slot
  window             SnapKV / AnDPro window scores              core/window_scores.py
  compaction         in-place move of kept K, V and scores to   core/compaction.py
                     a row's first slots (the ordered compact;
                     the CPU path fills holes instead)
  partial_attention  InfiniGen's partial q~ K~^T and max-alpha  core/offload.py

Kernels (`jit/`) are apart from their launchers (this folder: shape, dtype and
stride checks); `reference.py` holds the plain-torch references. Importing this
package imports no Triton; `vllm_kvevict.core.kernel_dispatch` decides when to use them.
"""
