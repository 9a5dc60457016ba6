#!/usr/bin/env bash
# Tensor-parallel serving over Ray with H2O eviction.
#
# Multi-node GPU cluster (NOT run here: this project's machines have no GPU):
#   head node:    ray start --head --port 6379
#   other nodes:  ray start --address HEAD_IP:6379
#   head node:    vllm serve MODEL --tensor-parallel-size 8 \
#                     --distributed-executor-backend ray --kv-eviction h2o --kv-budget 1024
# vLLM loads this plugin in every Ray worker (general plugins); the package must
# be installed on every node.
#
# This machine (CPU, run and tested here): two ranks on cores 0 and 1 of a local
# Ray instance that vLLM starts itself (patches/ray_on_cpu.py lets the CPU
# platform use the Ray executor). Qwen2.5-Coder-0.5B has 2 KV heads, one per rank.
#   bash examples/serve_ray_tp.sh [MODEL]
set -euo pipefail
MODEL=${1:-$(python -m vllm_kvevict.models qwen25-coder | tail -1)}
VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_CPU_KVCACHE_SPACE=1 vllm serve "$MODEL" --port 8000 \
    --enforce-eager --block-size 32 --max-model-len 4096 \
    --tensor-parallel-size 2 --distributed-executor-backend ray \
    --kv-eviction h2o --kv-budget 256 &
SERVER=$!
trap 'kill -INT $SERVER; wait $SERVER; ray stop --force >/dev/null 2>&1 || true' EXIT
until curl -sf localhost:8000/health >/dev/null; do sleep 2; done
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"max_tokens\": 300, \"temperature\": 0,
  \"prompt\": \"Write a long story about a lighthouse keeper.\"}"
echo
curl -s localhost:8000/metrics | grep ^vllm_kvevict
