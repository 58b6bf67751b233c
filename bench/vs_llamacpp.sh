#!/usr/bin/env bash
# radixserve against llama.cpp on the same SmolLM2 weights: the embedded GGUF rewritten
# with bfloat16 tensors (bench/gguf_bf16.py; radixserve computes that model in bfloat16
# too). Two shapes through the same OpenAI /v1/completions client, prompts sent as text
# (both servers tokenize them the same way):
#   single   shared-prefix one request at a time (single-stream latency)
#   shared   shared-prefix with every request sent at once
# One fresh server per shape and side; a table per shape and the ratios at the end.
# llama.cpp streams no usage, so its hit rate is not known (shown as -).
#
# The peer (PEER):
#   llama-server (default)  llama.cpp's C++ server, what a CPU user runs: built by
#       bench/llama_server.sh (LLAMA_SERVER: its path), continuous batching, NP parallel
#       slots (default 32: every request of the shared shape at once, as radixserve
#       runs them), a context of NP x 1152 tokens (each slot holds a prompt and its
#       answer), prompt-cache reuse (--cache-reuse 256), THREADS threads.
#   llama-cpp-python        llama-cpp-python's Python server (one request at a time;
#       --cache true in RAM), in its own venv:
#         python -m venv .venv-llamacpp
#         CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-llamacpp/bin/pip install "llama-cpp-python[server]"
# Both live out of the package and out of CI.
#
#   bench/llama_server.sh && bench/vs_llamacpp.sh
#   PEER=llama-cpp-python bench/vs_llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PEER=${PEER:-llama-server}
LPY=${LPY:-.venv-llamacpp/bin/python}
LLAMA_SERVER=${LLAMA_SERVER:-.llama-server/build/bin/llama-server}
NP=${NP:-32}
PORT=${PORT:-8393}
THREADS=${THREADS:-$(nproc)}
GGUF=${GGUF:-bench/results/smollm2-bf16.gguf}
OUT=${OUT:-bench/results/vs-llamacpp-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$(dirname "$OUT")"
case $PEER in
  llama-server) [[ -x "$LLAMA_SERVER" ]] || { echo "no llama-server at $LLAMA_SERVER (bench/llama_server.sh builds it)" >&2; exit 2; } ;;
  llama-cpp-python) [[ -x "$LPY" ]] || { echo "no llama-cpp-python venv at .venv-llamacpp (see the top of this file)" >&2; exit 2; } ;;
  *) echo "PEER is llama-server or llama-cpp-python, not $PEER" >&2; exit 2 ;;
esac
[[ $NP =~ ^[1-9][0-9]*$ ]] || { echo "NP (llama-server's slots) must be a positive integer, not $NP" >&2; exit 2; }
echo "peer: $PEER"
[[ -f "$GGUF" ]] || "$PY" bench/gguf_bf16.py "$GGUF"
echo "uptime before: $(uptime)"
grep -m1 'model name' /proc/cpuinfo || true
grep -o -m1 -w 'amx_bf16\|avx512_bf16' /proc/cpuinfo | head -1 || echo "no bf16 instructions"
WORK="--groups 4 --prompts 8 --system-len 1000 --question-len 30 --output-len 32 --seed 5"

wait_up() {  # $1: pid, $2: log
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { tail -20 "$2"; exit 1; }
    sleep 1
  done
  echo "server did not come up" >&2; exit 1
}

run_shape() {  # $1: shape, $2: side name (the server is fresh: its cache holds nothing)
  conc=""; [[ $1 == single ]] && conc="--max-concurrency 1"
  # shellcheck disable=SC2086
  "$PY" -m radixserve.cli bench shared-prefix $WORK $conc --no-plot --no-progress \
    --backend openai --served-model smollm2 --base-url "http://127.0.0.1:$PORT/v1" \
    --text-prompts --output "$OUT-$1-$2" > /dev/null
}

PID=""
trap '[[ -n $PID ]] && kill $PID 2>/dev/null || true' EXIT
# One fresh server per shape and side, so that no shape finds another's prefixes cached.
for shape in single shared; do
  if [[ $PEER == llama-server ]]; then
    "$LLAMA_SERVER" -m "$GGUF" --alias smollm2 -c $((NP * 1152)) -np "$NP" --cont-batching \
      --cache-reuse 256 -t "$THREADS" -tb "$THREADS" --host 127.0.0.1 --port "$PORT" \
      > "$OUT-llamacpp-server.log" 2>&1 &
  else
    "$LPY" -m llama_cpp.server --model "$GGUF" --model_alias smollm2 --n_ctx 8192 \
      --n_threads "$THREADS" --n_threads_batch "$THREADS" --cache true --cache_size 4294967296 \
      --interrupt_requests false --host 127.0.0.1 --port "$PORT" > "$OUT-llamacpp-server.log" 2>&1 &
  fi
  PID=$!
  wait_up $PID "$OUT-llamacpp-server.log"
  run_shape "$shape" llamacpp
  kill $PID; wait $PID 2>/dev/null || true

  "$PY" -m radixserve.cli launch --model smollm2 --port 0 --http-port "$PORT" \
    > "$OUT-radixserve-server.log" 2>&1 &
  PID=$!
  wait_up $PID "$OUT-radixserve-server.log"
  run_shape "$shape" radixserve
  kill $PID; wait $PID 2>/dev/null || true
  PID=""
done

"$PY" - "$OUT" "$PEER" <<'PYEOF'
import json, sys
from radixserve.benchmark import report
out, peer = sys.argv[1], sys.argv[2]
rows = []
for shape, title in (("single", "one request at a time"), ("shared", "all at once")):
    docs = [json.load(open(f"{out}-{shape}-{side}.json")) for side in ("llamacpp", "radixserve")]
    variants = [{**d["variants"][0], "label": label}
                for d, label in zip(docs, (peer, "radixserve launch"))]
    print(report.table(f"shared-prefix, {title}", variants))
    l, r = (x["metrics"] for x in variants)
    rows.append((title, r["output_tok_s"] / l["output_tok_s"], r["ttft_mean_ms"] / l["ttft_mean_ms"],
                 r["itl_mean_ms"] / l["itl_mean_ms"], r["e2e_mean_ms"] / l["e2e_mean_ms"]))
print("\n| shared-prefix | throughput vs llama.cpp | TTFT mean | ITL mean | e2e mean |")
print("|---|---|---|---|---|")
for title, tp, ttft, itl, e2e in rows:
    print(f"| {title} | {tp:.2f}x | {ttft:.2f}x | {itl:.2f}x | {e2e:.2f}x |")
PYEOF
echo "uptime after: $(uptime)"
