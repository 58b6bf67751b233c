"""SGLang's model gateway (``sglang-router``) in front of two radixserve replicas.

Starts two ``radixserve launch --http-port`` servers (default: the embedded
SmolLM2) and ``sglang-router launch --worker-urls A B --policy cache_aware``, then
sends requests that share a few long prefixes through the gateway, on SGLang's
``/generate`` and on OpenAI's ``/v1/completions``. Prints, per replica, how many
requests it served (prompt tokens) and its prefix-cache hit rate (from radixserve's own stats), so
one sees whether the gateway's cache-aware policy kept each prefix on one replica.

    bench/sglang_frontend.sh makes the venv; then
    .venv/bin/python bench/sglang_router.py [--router .venv-sglang/bin/sglang-router]
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--port", "0", "--http-port", "0"]
    proc = subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"http on (\S+)", line):
            return proc, m.group(1).rstrip("/")
    raise RuntimeError("a replica did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default=".venv-sglang/bin/sglang-router")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("launch", nargs="*", help="extra `radixserve launch` flags (after --)")
    args = ap.parse_args()
    replicas = [launch(args.launch) for _ in range(2)]
    urls = [u for _, u in replicas]
    port = free_port()
    gateway = subprocess.Popen(
        [args.router, "launch", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *urls, "--policy", "cache_aware"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=300) as c:
            for _ in range(120):
                try:
                    if c.get(base + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            model = c.get(urls[0] + "/v1/models").json()["data"][0]["id"]
            docs = [f"Document {d}: " + " ".join(f"fact {d}.{i} is true." for i in range(60))
                    for d in range(4)]  # fmt: skip
            codes = []
            for i in range(args.requests):
                prompt = docs[i % 4] + f"\nQuestion {i}: which fact comes first?\nAnswer:"
                if i % 2:
                    r = c.post(
                        base + "/generate",
                        json={
                            "text": prompt,
                            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                        },
                    )
                else:
                    r = c.post(
                        base + "/v1/completions",
                        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
                    )
                codes.append(r.status_code)  # fmt: skip
                if r.status_code != 200 and codes.count(r.status_code) == 1:
                    print(f"first {r.status_code} from the gateway: {r.text[:300]}")
            print(f"gateway answers: {codes.count(200)} of {len(codes)} with 200 "
                  f"({sorted(set(codes))})")  # fmt: skip
            print(f"{'replica':<28}{'prompt tokens':>14}{'hit rate':>10}")
            for u in urls:
                stats = c.get(u + "/get_server_info").json()["internal_states"][0]
                q, h = stats.get("query_tokens", 0), stats.get("hit_tokens", 0)
                print(f"{u:<28}{q:>14}{(h / q if q else 0):>10.2f}")
    finally:
        gateway.terminate()
        for proc, _ in replicas:
            proc.terminate()
        for proc, _ in replicas:
            proc.wait(60)
        gateway.wait(30)


if __name__ == "__main__":
    main()
