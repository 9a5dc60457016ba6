# Shared by scripts/setup.sh and scripts/setup_kvpress.sh (sourced, not run).
# The caller sets VENV, PY (="$VENV/bin/python"), TORCH_VERSION and LOG_TAG.

log() { printf '[%s] %s\n' "$LOG_TAG" "$*"; }

# pip, quiet, minus the harmless "Location ... is ignored" lines that an
# extra index without this package prints; errors still show, and fail.
pip_q() {
    "$PY" -m pip -q "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

# has DIST VERSION: exit 0 if distribution DIST is installed at exactly VERSION.
has() {
    "$PY" - "$1" "$2" <<'PYEOF'
import importlib.metadata as m, sys
try:
    sys.exit(m.version(sys.argv[1]) != sys.argv[2])
except m.PackageNotFoundError:
    sys.exit(1)
PYEOF
}

# The venv, then CPU torch first, so that nothing installed after it resolves
# torch to a CUDA build (the local wheel is found by plain `pip install`).
venv_with_cpu_torch() {
    if [[ ! -x "$PY" ]]; then
        log "creating $VENV with ${PYTHON:-python3.11}"
        "${PYTHON:-python3.11}" -m venv "$VENV"
    fi
    if ! has torch "$TORCH_VERSION"; then
        log "installing torch==$TORCH_VERSION"
        pip_q install "torch==$TORCH_VERSION"
    fi
}
