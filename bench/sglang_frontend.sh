#!/usr/bin/env bash
# SGLang's frontend language against radixserve: makes a venv for SGLang's frontend
# (SGLANG_VENV, default .venv-sglang; it sees .venv's packages, so the CPU torch and
# radixserve, through a .pth file), launches `radixserve launch --http-port` with the
# embedded SmolLM2 (RUN_FLAGS adds flags), runs bench/sglang_frontend.py against it and
# stops the server. SGLang's full dependency set would pull a CUDA torch: only the
# frontend's few are installed, and SGLang itself with --no-deps.
#
#   bench/sglang_frontend.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
if [[ ! -x "$SGLANG_VENV/bin/python" ]]; then
  python3 -m venv "$SGLANG_VENV"
  site=$("$PY" -c "import site; print(site.getsitepackages()[0])")
  own=$("$SGLANG_VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$site" > "$own/_radixserve_base.pth"
  "$SGLANG_VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
  "$SGLANG_VENV/bin/pip" install -q orjson pybase64 pillow psutil zstandard xxhash requests \
    msgspec ipython
fi
log=$(mktemp)
"$PY" -m radixserve.cli launch --port 0 --http-port 0 ${RUN_FLAGS:-} > "$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do
  url=$(grep -o 'http on [^ ]*' "$log" | awk '{print $3}' || true)
  [[ -n "$url" ]] && break
  kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.5
done
echo "radixserve HTTP front at $url"
"$SGLANG_VENV/bin/python" bench/sglang_frontend.py "${url%/}"
