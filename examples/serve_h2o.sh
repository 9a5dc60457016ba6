#!/usr/bin/env bash
# Serve the OpenAI API with H2O eviction, then ask it one question.
#   bash examples/serve_h2o.sh [MODEL]
set -euo pipefail
MODEL=${1:-$(python -m vllm_kvevict.models)}
PORT=${PORT:-8000}
VLLM_CPU_KVCACHE_SPACE=1 vllm serve "$MODEL" --port "$PORT" --enforce-eager \
    --block-size 32 --max-model-len 4096 \
    --kv-eviction h2o --kv-budget 256 --kv-recent 64 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf "localhost:$PORT/health" >/dev/null; do
    kill -0 $SERVER 2>/dev/null || exit 1  # the server died: its log is above
    sleep 2
done
curl -s "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"max_tokens\": 300, \"temperature\": 0,
  \"messages\": [{\"role\": \"user\", \"content\": \"Tell me a long story about a robot.\"}]}"
echo
