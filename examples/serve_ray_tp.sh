#!/usr/bin/env bash
# Tensor- and pipeline-parallel serving over Ray with H2O eviction.
#
# Multi-node GPU cluster (NOT run here: this project's machines have one node
# and no GPU). Install the same vLLM (0.32) and this plugin on every node; vLLM
# loads the plugin in every Ray worker (a `vllm.general_plugins` entry point).
# Two nodes of 8 GPUs: tensor parallel inside a node, one pipeline stage per node.
#   head node:    ray start --head --port 6379
#   other node:   ray start --address HEAD_IP:6379
#   head node:    vllm serve MODEL --tensor-parallel-size 8 --pipeline-parallel-size 2 \
#                     --distributed-executor-backend ray \
#                     --kv-eviction h2o --kv-budget 1024
#   when done:    ray stop   (on every node)
# Each stage scores and compacts its own layers by the scheduler's one plan
# (docs/serving.md); offload (--kv-eviction infinigen, --kv-swap-space) and
# prompt modules are refused at --pipeline-parallel-size > 1.
#
# This machine (CPU, one node, loopback; this is what was run here):
#   bash examples/serve_ray_tp.sh [MODEL]                 # TP 2
#   TP=1 PP=2 bash examples/serve_ray_tp.sh [MODEL]       # PP 2
#   TP=2 PP=2 bash examples/serve_ray_tp.sh [MODEL]       # TP 2 x PP 2: 4 workers on
#       2 cores: it started and generated at about 1 tok/s here (interrupted); use >= 4 cores
# A Ray head on 127.0.0.1 with one CPU per worker, then `vllm serve` at TP x PP
# over it (patches/ray_on_cpu.py lets the CPU platform use vLLM's Ray executor);
# VLLM_CPU_OMP_THREADS_BIND puts worker i on core i mod (cores), e.g. "0|1".
# Qwen2.5-Coder-0.5B has 2 KV heads (TP 2: one per rank) and 24 layers (PP 2:
# 12 per stage). One completion, the plugin's metrics, then the server and this
# Ray instance are stopped.
set -euo pipefail
MODEL=${1:-$(python -m vllm_kvevict.models qwen25-coder | tail -1)}
RAY_PORT=${RAY_PORT:-6390}
PORT=${PORT:-8000}
TP=${TP:-2}
PP=${PP:-1}
WORKERS=$((TP * PP))
CORES=$(nproc)
BIND=$(seq 0 $((WORKERS - 1)) | awk -v c="$CORES" '{printf "%s%d", (NR > 1 ? "|" : ""), $1 % c}')

# Single node: Ray keeps 127.0.0.1 as the node's address and listens only there
# (by default on Linux it swaps in the host's routable address and listens on
# every interface). Read by every Ray process, vLLM's Ray driver included.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Ray and the server each get their own process group (setsid), so that
# stopping one stops all of it: `ray stop` would stop every Ray on the machine,
# and a server stopped while still starting would leave its EngineCore behind.
stop() {  # SIGTERM process group $1, SIGKILL after 30 s
    kill -TERM -- "-$1" 2>/dev/null || return 0
    for _ in $(seq 30); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- "-$1" 2>/dev/null || true
}
RAY_LOG=$(mktemp)
RAY_PID= SERVER=
cleanup() {
    [[ -n $SERVER ]] && stop "$SERVER"
    [[ -n $RAY_PID ]] && stop "$RAY_PID"
    rm -f "$RAY_LOG"
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # through cleanup
# --block: this Ray instance lives as long as that one process.
setsid ray start --head --node-ip-address 127.0.0.1 --port "$RAY_PORT" --num-cpus "$WORKERS" \
    --object-store-memory $((256 << 20)) --include-dashboard false \
    --disable-usage-stats --block >"$RAY_LOG" 2>&1 &
RAY_PID=$!
until grep -q "Ray runtime started" "$RAY_LOG"; do
    kill -0 "$RAY_PID" 2>/dev/null || { cat "$RAY_LOG"; exit 1; }  # ray start failed
    sleep 1
done

# vLLM's ray.init() finds the instance started above on this machine.
VLLM_CPU_OMP_THREADS_BIND="$BIND" VLLM_CPU_KVCACHE_SPACE=1 setsid vllm serve "$MODEL" --port "$PORT" \
    --enforce-eager --block-size 32 --max-model-len 4096 \
    --tensor-parallel-size "$TP" --pipeline-parallel-size "$PP" \
    --distributed-executor-backend ray \
    --kv-eviction h2o --kv-budget 128 &
SERVER=$!
until curl -sf "localhost:$PORT/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || exit 1  # the server died
    sleep 2
done
curl -s "localhost:$PORT/v1/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"max_tokens\": 200, \"temperature\": 0,
  \"prompt\": \"Write a long story about a lighthouse keeper.\"}"
echo
curl -s "localhost:$PORT/metrics" | grep ^vllm_kvevict
