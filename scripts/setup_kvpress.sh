#!/usr/bin/env bash
# Set up .venv-kvpress: an isolated venv with NVIDIA's kvpress on CPU torch,
# for the side-by-side quality runs of vllm_kvevict/eval/kvpress_runner.py.
# No vLLM here (kvpress pins transformers < 5.3; our .venv has 5.19 for vLLM).
#
# Idempotent: packages already at the pinned version are not touched again,
# so a second run takes seconds. Usage (from anywhere): bash scripts/setup_kvpress.sh
# Env: PYTHON (default python3.11) creates the venv.
#
# Then, from the repository root:
#   PYTHONPATH=$PWD .venv-kvpress/bin/python -m vllm_kvevict.eval.kvpress_runner \
#       --tasks TASKS.json --out kvpress.json
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION=2.13.0+cpu       # local CPU wheel (pip find-links); never a CUDA torch
KVPRESS_VERSION=0.5.5
TRANSFORMERS_VERSION=5.2.0     # kvpress 0.5.5 requires transformers>=4.56,<5.3: the newest allowed
ACCELERATE_VERSION=1.15.0      # kvpress: accelerate>=1,<2 (same as .venv)
TQDM_VERSION=4.70.1            # the runner's progress bar (same as .venv)
VENV=.venv-kvpress
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

LOG_TAG=setup-kvpress
source scripts/venv_lib.sh  # log, pip_q, has, venv_with_cpu_torch

venv_with_cpu_torch  # before kvpress, so that it keeps the CPU torch

if ! has kvpress "$KVPRESS_VERSION" || ! has transformers "$TRANSFORMERS_VERSION" \
        || ! has accelerate "$ACCELERATE_VERSION" || ! has tqdm "$TQDM_VERSION"; then
    log "installing kvpress==$KVPRESS_VERSION transformers==$TRANSFORMERS_VERSION"
    # torch pinned again so the resolver keeps the CPU build.
    pip_q install "kvpress==$KVPRESS_VERSION" "transformers==$TRANSFORMERS_VERSION" \
        "accelerate==$ACCELERATE_VERSION" "tqdm==$TQDM_VERSION" "torch==$TORCH_VERSION"
fi

# No CUDA torch, no nvidia-* wheels, no vLLM, no flash-attn in this venv.
bad=$("$PY" -m pip list --format=freeze 2>/dev/null \
      | grep -iE '^(nvidia-|vllm|flash[-_]attn|triton|cuda-)' || true)
if [[ -n "$bad" ]]; then
    log "ERROR: unwanted packages in $VENV:"; printf '  %s\n' $bad >&2; exit 1
fi
has torch "$TORCH_VERSION" || { log "ERROR: torch is not $TORCH_VERSION"; exit 1; }

# kvpress imports and compresses on CPU (a random tiny Llama, no download):
# every press the runner uses, eager attention (ObservedAttentionPress needs it).
"$PY" - <<'EOF'
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from kvpress import CriticalKVPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress

assert not torch.cuda.is_available() and torch.version.cuda is None, "not a CPU torch"
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
cfg._attn_implementation = "eager"
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 128, (1, 96))
for press in (ObservedAttentionPress(0.5), SnapKVPress(0.5, window_size=32),
              StreamingLLMPress(0.5), CriticalKVPress(SnapKVPress(0.5, window_size=32))):
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert cache.get_seq_length() == 48, (type(press).__name__, cache.get_seq_length())
from importlib.metadata import version
print(f"[setup-kvpress] kvpress {version('kvpress')} compresses on CPU (torch {torch.__version__}, "
      f"transformers {version('transformers')})")
EOF

log "done: $("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|kvpress)==' | tr '\n' ' ')"
