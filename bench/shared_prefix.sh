#!/usr/bin/env bash
# Shared-prefix benchmark with the embedded SmolLM2 on a CPU: 8 groups x 8 prompts
# sharing a 1000-token system prompt per group (30-token questions, 32 output tokens),
# against two fresh servers, prefix cache on (radix) and off (none). A few minutes on
# 2 cores. Extra arguments are passed on, e.g.:
#   bench/shared_prefix.sh --prompt-kind text
#   bench/shared_prefix.sh --compare page-size=1,16     (instead of cache=radix,none)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
args=(--groups 8 --prompts 8 --system-len 1000 --question-len 30 --output-len 32)
if [[ " $* " != *" --compare "* ]]; then
  args+=(--compare cache=radix,none)
fi
exec "$PY" -m radixserve.cli bench shared-prefix "${args[@]}" "$@"
