#!/usr/bin/env bash
# Talk to `dflash-mlx serve` with curl.   BASE=http://127.0.0.1:8080 KEY=<--api-key, if any> ./curl.sh
set -euo pipefail
BASE=${BASE:-http://127.0.0.1:8080}
AUTH=()
if [ -n "${KEY:-}" ]; then AUTH=(-H "Authorization: Bearer $KEY"); fi
MODEL=${MODEL:-$(curl -s "${AUTH[@]}" "$BASE/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')}

# Chat, streamed as server-sent events.
curl -sN "${AUTH[@]}" "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"stream\": true, \"max_tokens\": 64, \"temperature\": 0,
  \"messages\": [{\"role\": \"user\", \"content\": \"Write a haiku about Metal kernels.\"}]
}"

# Fill in the middle (editor autocomplete): the model writes what goes between prompt and suffix.
curl -s "${AUTH[@]}" "$BASE/v1/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"max_tokens\": 32, \"temperature\": 0,
  \"prompt\": \"def mean(values):\\n    \", \"suffix\": \"\\n    return total / len(values)\\n\"
}"
echo
curl -s "$BASE/metrics" | grep -E '^dflash_(tokens_per_cycle|acceptance_rate|generation_tokens_per_second)'
