#!/usr/bin/env bash
# Stream an answer over HTTP server-sent events from a running `trtserve serve`.
#   bash examples/curl_sse.sh "What is the capital of France?" [http://127.0.0.1:8000]
set -euo pipefail
prompt=${1:-"What is the capital of France?"}
url=${2:-http://127.0.0.1:8000}
messages=$(python3 -c 'import json, sys; print(json.dumps(json.dumps([{"role": "user", "content": sys.argv[1]}])))' "$prompt")
curl --no-buffer -sS -X POST "$url/v2/models/llm/generate_stream" \
  -d "{\"messages\": $messages, \"max_tokens\": 64, \"stream\": true}"
echo
