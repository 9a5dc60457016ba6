"""Triton kernels for the plugin's CUDA path, shipped as `vllm_kvevict.triton_kernels`.
vLLM probes for OpenAI's top-level `triton_kernels` package (MoE kernels); a
command run from the repository root would find this folder under that name,
so `register()` keeps the name for the real package (`free_top_level_name`).

  module             kernel                                     the CPU path it mirrors
  paged_attention    decode attention over the NHD paged cache  core/scoring/scores.py (H2O)
                     that also adds H2O scores per slot
  window             SnapKV / AnDPro window scores              core/scoring/window_scores.py
  compaction         in-place move of kept K, V and scores to   core/eviction/compaction.py
                     a row's first slots (the ordered compact;
                     the CPU path fills holes instead)
  partial_attention  InfiniGen's partial q~ K~^T and max-alpha  core/offload/decode_attention.py

Kernels (`jit/`) are apart from their launchers (this folder: shape, dtype and
stride checks); `reference.py` holds the plain-torch references. Importing this
package imports no Triton; `vllm_kvevict.core.eviction.kernel_dispatch` decides when to use them.
"""


def free_top_level_name() -> None:
    """If `import triton_kernels` would load a clone's kernels folder (its root
    on sys.path, e.g. `python -m vllm_kvevict.demo` run there), make it load
    OpenAI's package from the rest of sys.path instead, or fail as if none were
    installed. Before, vLLM took the folder for OpenAI's package and logged
    "Failed to import Triton kernels" in every process started from the root
    (on CUDA it would have lost its MoE kernels there)."""
    import importlib.machinery
    import importlib.util
    import logging
    import os
    import sys

    name = "triton_kernels"
    if name in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec(name)
    if spec is None or spec.origin is None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
    if not os.path.isfile(os.path.join(root, "vllm_kvevict", "__init__.py")):
        return  # not a clone of this repository: the name is someone else's
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    real = importlib.machinery.PathFinder.find_spec(name, rest)
    if real is None or real.loader is None:
        sys.modules[name] = None  # find_spec() -> None and import fails: "not installed"
        return
    module = importlib.util.module_from_spec(real)
    sys.modules[name] = module
    try:
        real.loader.exec_module(module)
    except Exception:  # a broken install: vLLM's own probe would call it absent too
        sys.modules[name] = None
        logging.getLogger(__name__).warning("%s at %s failed to import", name, real.origin,
                                            exc_info=True)
