#!/usr/bin/env bash
# Prepare, on a CPU machine with network access to the package index, what
# bench/gpu_check.sh needs on a GPU machine that has none (see docs/gpu.md, "Checking a GPU install"):
#   .whl/                 wheels installed there with --no-deps (apache-tvm-ffi, gguf)
#   .fi/flashinfer.tar.xz flashinfer-python, trimmed to what import + JIT need
# Both folders must be git-ignored (this script adds them to .git/info/exclude)
# and carried to the GPU machine. The full flashinfer wheel (about 100 MB) is too
# big to carry; the trimmed package packs to about 18 MB.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.4}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-}  # empty: the newest that flashinfer's pin allows
PY=${PYTHON:-python3}
exclude=$(git rev-parse --git-path info/exclude)
for d in /.whl/ /.fi/; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >>"$exclude"; done
mkdir -p .whl .fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The GPU image runs CPython 3.12 on x86-64 (manylinux).
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps "${platform[@]}" -d .whl \
  "apache-tvm-ffi${TVM_FFI_VERSION:+==$TVM_FFI_VERSION}<0.2" gguf
"$PY" -m pip download -q --no-deps -d "$tmp" "flashinfer-python==$FLASHINFER_VERSION"

# Keep the Python sources, JSON metadata, the top-level kernel sources (the fa2
# prefill/decode and page modules compile from those) and the headers; drop the
# csrc subfolders (MoE, MLA, fp4, ... about 380 MB) and prebuilt extras.
# 0.7.4: 204 MB unpacked, 17.7 MB as .tar.xz (xz takes a minute or two).
mkdir "$tmp/pkg"
(cd "$tmp/pkg" && unzip -q "$tmp"/flashinfer_python-*.whl \
  'flashinfer/*.py' 'flashinfer/*.json' 'flashinfer/data/csrc/*' \
  'flashinfer/data/include/*' 'flashinfer/data/cutlass/*' 'flashinfer/data/cccl/*' \
  'flashinfer/data/spdlog/*' 'flashinfer_python-*.dist-info/*' \
  -x 'flashinfer/data/csrc/*/*')
tar -C "$tmp/pkg" -cJf .fi/flashinfer.tar.xz .
du -sh .whl .fi/flashinfer.tar.xz
