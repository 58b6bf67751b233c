#!/usr/bin/env bash
# Builds llama.cpp's C++ server (`llama-server`: continuous batching, parallel slots,
# prompt-cache reuse) from the llama.cpp source that the llama-cpp-python sdist vendors,
# for this CPU (-DGGML_NATIVE=ON), into $DEST (default .llama-server/, out of the
# package and out of CI). bench/vs_llamacpp.sh runs it against radixserve.
#
#   bench/llama_server.sh                       # ~20 min on 2 cores
#   LLAMA_CPP_PYTHON=0.3.36 bench/llama_server.sh
#
# Prints the binary's path last. Needs cmake and a C++ compiler; nothing is fetched but
# the sdist (pip download).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.llama-server}
SPEC=llama-cpp-python${LLAMA_CPP_PYTHON:+==$LLAMA_CPP_PYTHON}
mkdir -p "$DEST"
if ! compgen -G "$DEST/llama_cpp_python-*.tar.gz" > /dev/null; then
  "$PY" -m pip download --quiet --no-binary :all: --no-deps "$SPEC" -d "$DEST"
fi
SDIST=$(ls -t "$DEST"/llama_cpp_python-*.tar.gz | head -1)
SRC="$DEST/$(basename "$SDIST" .tar.gz)"
[[ -d $SRC ]] || tar -xzf "$SDIST" -C "$DEST"
cmake -S "$SRC/vendor/llama.cpp" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$DEST/cmake.log"
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" > "$DEST/build.log"
echo "$(basename "$SRC") -> $DEST/build/bin/llama-server"
