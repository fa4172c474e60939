#!/usr/bin/env bash
# Claude Code against `dflash-mlx serve` (Anthropic's Messages API on /v1/messages).
# `dflash-mlx agent claude [-- ARGS]` does all of this (and starts the server); by hand:
#   dflash-mlx serve --draft-quant w4 --port 8080 --model-name qwopus [--api-key KEY] &
#   KEY=<the --api-key, if any> ./claude-code.sh [-p "..."]
# Claude Code sends its token as `Authorization: Bearer` (ANTHROPIC_AUTH_TOKEN) or as `x-api-key`
# (ANTHROPIC_API_KEY); the server takes either. Every model variable names the served model, so
# that Claude Code's background (haiku) and sub-agent requests go to it too (the server serves any
# name with its model, and logs names it does not know once). Telemetry and update checks off.
set -euo pipefail
export ANTHROPIC_BASE_URL=${BASE:-http://127.0.0.1:8080}
export ANTHROPIC_AUTH_TOKEN=${KEY:-none}
unset ANTHROPIC_API_KEY
export ANTHROPIC_MODEL=${MODEL:-qwopus}
export ANTHROPIC_SMALL_FAST_MODEL=$ANTHROPIC_MODEL ANTHROPIC_DEFAULT_HAIKU_MODEL=$ANTHROPIC_MODEL
export ANTHROPIC_DEFAULT_SONNET_MODEL=$ANTHROPIC_MODEL ANTHROPIC_DEFAULT_OPUS_MODEL=$ANTHROPIC_MODEL
export CLAUDE_CODE_MAX_CONTEXT_TOKENS=${CONTEXT:-262144}   # the server's --context-size (see /health)
export DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
exec claude "$@"
