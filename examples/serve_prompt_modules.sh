#!/usr/bin/env bash
# Serve with prompt modules: register a schema, ask through completions and
# chat, remove it. The schema routes are an endpoint plugin, which vLLM loads
# only when named in VLLM_PLUGINS.
#   bash examples/serve_prompt_modules.sh [MODEL]
set -euo pipefail
MODEL=${1:-$(python -m vllm_kvevict.models)}
PORT=${PORT:-8000}
VLLM_PLUGINS=kvevict,kvevict_modules VLLM_CPU_KVCACHE_SPACE=1 vllm serve "$MODEL" \
    --port "$PORT" --enforce-eager --block-size 32 --max-model-len 4096 \
    --enable-prompt-tokens-details &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf "localhost:$PORT/health" >/dev/null; do
    kill -0 $SERVER 2>/dev/null || exit 1  # the server died: its log is above
    sleep 2
done
J='Content-Type: application/json'
# A JSON string holds no raw line breaks: the schema's are \n escapes.
curl -s "localhost:$PORT/v1/kvevict/schemas" -H "$J" --data-binary @- <<'EOF'
{"pml": "<schema name=\"city\">You are a guide.\n<module name=\"paris\">Paris is the capital of France. The Louvre, the largest art museum in the world, stands on the right bank of the Seine, and the Eiffel Tower was built for the 1889 World Fair.</module>\n<module name=\"rome\">Rome is the capital of Italy. The Colosseum held fifty thousand spectators, and the Pantheon has the largest unreinforced concrete dome ever built.</module></schema>"}
EOF
echo
curl -s "localhost:$PORT/v1/completions" -H "$J" -d "{\"model\": \"$MODEL\", \"max_tokens\": 30,
  \"temperature\": 0, \"prompt\": \"<prompt schema=\\\"city\\\"><rome/><paris/>Which museum is the largest? Answer:</prompt>\"}"
echo
curl -s "localhost:$PORT/v1/chat/completions" -H "$J" -d "{\"model\": \"$MODEL\", \"max_tokens\": 30,
  \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\":
  \"<prompt schema=\\\"city\\\"><paris/>How tall is the dome in Rome?</prompt>\"}]}"
echo
curl -s "localhost:$PORT/v1/kvevict/schemas"; echo
curl -s -X DELETE "localhost:$PORT/v1/kvevict/schemas/city"; echo
