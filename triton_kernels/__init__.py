"""Triton kernels for the plugin's CUDA path, shipped as `vllm_kvevict.triton_kernels`
(vLLM probes for a top-level `triton_kernels` module, so this folder never is one).

  paged_attention    decode attention over the NHD paged cache that also adds
                     H2O scores (softmax summed over each GQA group) per slot
  window             SnapKV / AnDPro window scores for a compaction
  compaction         in-place move of kept K, V and scores to a row's first slots
  partial_attention  InfiniGen's partial q~ K~^T and max - alpha threshold

Kernels (`jit/`) are apart from their launchers (this folder: shape, dtype and
stride checks); `reference.py` holds the plain-torch references. Importing this
package imports no Triton; `vllm_kvevict.core.kernel_dispatch` decides when to use them.
"""
