#!/usr/bin/env bash
# Claude Code against `dflash-mlx serve` (Anthropic's Messages API on /v1/messages).
#   dflash-mlx serve --draft-quant w4 --port 8080 --model-name qwopus [--api-key KEY] &
#   KEY=<the --api-key, if any> ./claude-code.sh
# Claude Code sends its token as `Authorization: Bearer` (ANTHROPIC_AUTH_TOKEN) or as `x-api-key`
# (ANTHROPIC_API_KEY); the server takes either. Both model variables name the served model, so
# that Claude Code's background requests go to it too.
set -euo pipefail
export ANTHROPIC_BASE_URL=${BASE:-http://127.0.0.1:8080}
export ANTHROPIC_AUTH_TOKEN=${KEY:-none}
export ANTHROPIC_MODEL=${MODEL:-qwopus}
export ANTHROPIC_SMALL_FAST_MODEL=$ANTHROPIC_MODEL
exec claude "$@"
