#!/usr/bin/env bash
# The GPU check, run from the repository root on a CUDA machine without network:
#   bash bench/gpu_check.sh [quick|full|all] [pytest args]
#     quick (default): the selection probe, then tests/worker/test_flashinfer_gpu.py -k quick
#                      (bf16, head_dim 128, fa2: three kernel variants; fits one 10-minute
#                      run on a fresh machine that JIT-builds them)
#     full:            the other GPU tests (every dtype, head_dim, page size, window, soft-cap,
#                      long contexts, fa3, SmolLM2); many more kernels to build
#     all:             both
# Needs what bench/gpu_prepare.sh made (.whl/ and .fi/, carried along). Results go to
# $OUT (or /tmp/gpu_check): gpu_check.log and junit XML per tier.
set -uo pipefail
cd "$(dirname "$0")/.."
tier=${1:-quick}
case "$tier" in quick|full|all) shift || true ;; *) tier=quick ;; esac
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
log="$out/gpu_check.log"
site=/tmp/site
mkdir -p "$site"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
fi
if [ -f .fi/flashinfer.tar.xz ]; then
  # Python's tarfile (lzma is in the standard library): the machine may lack xz.
  "$PY" - "$site" <<'PYEOF'
import sys, tarfile
with tarfile.open(".fi/flashinfer.tar.xz") as tar:
    tar.extractall(sys.argv[1], filter="data")
PYEOF
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# FlashInfer compiles each kernel variant with nvcc at first use: for this GPU only
# (e.g. 9.0a on H100/H200), with every core, into a cache outside the carried folders
# (they are replaced on every run; carry a filled cache only on purpose).
arch=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m >= 9 else ''))" 2>/dev/null || echo 9.0a)
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$arch}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}"
export RADIXSERVE_CACHE_DIR="${RADIXSERVE_CACHE_DIR:-/tmp/radixserve-cache}"

run_tier() {  # $1: name, $2: -k expression, then pytest args
  local name=$1 expr=$2
  shift 2
  "$PY" -m pytest tests/worker/test_flashinfer_gpu.py -q -rs -s -p no:cacheprovider \
    --durations=10 --junitxml="$out/gpu_check_$name.xml" -k "$expr" "$@"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  command -v nvcc && nvcc --version | tail -1
  "$PY" -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, \
'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  echo "FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
  status=0
  # The selection itself, as a server would run it at start (also fills the JIT cache).
  "$PY" -m radixserve.worker.attention.check_flashinfer --head-dim 128 --heads 8 \
    --kv-heads 2 --prefill-backend fa2 || status=1
  if [ "$tier" != full ]; then run_tier quick quick "$@" || status=1; fi
  if [ "$tier" != quick ]; then run_tier full "not quick" "$@" || status=1; fi
  date -u
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
