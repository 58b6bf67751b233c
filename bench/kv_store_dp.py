"""The shared KV store across replicas: ``radixserve bench multi-turn`` on two
replicas under round-robin routing (the worst case for local caches: a
conversation's next turn usually lands on the replica that did not see the last),
with and without ``--kv-store``, beside one replica alone.

    python bench/kv_store_dp.py [--conversations 8 --turns 4 ...] [--out bench/results/kv_store_dp]

Three launches of the same workload (``radixserve bench``'s own runner and metrics,
one JSON each under ``--out``):

* ``dp=1``: one replica (its hit rate is what the store should give back to two);
* ``dp=2 rr``: two replicas, ``--policy round_robin``, no store;
* ``dp=2 rr store``: the same with ``--kv-store mooncake://auto`` (the launch
  starts a ``mooncake_master`` on loopback, both replicas share it), pages written
  as they are computed;
* ``dp=2 rr store evict``: pages written as the pools evict them instead
  (``--kv-store-config '{"write": "evict"}'``).

A variant whose JSON is already under ``--out`` is not run again (``--fresh``: all).

Prints the hit rate and throughput of each, and the ratios the store is judged
by: the hit rate within 5 points of one replica's, output throughput over the
store-less two replicas'.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RR = ["--dp", "2", "--policy", "round_robin"]
EVICT = '{"write": "evict"}'
VARIANTS = (
    ("dp=1", ["--dp", "1"]),
    ("dp=2 rr", RR),
    ("dp=2 rr store", [*RR, "--kv-store", "mooncake://auto"]),
    ("dp=2 rr store evict", [*RR, "--kv-store", "mooncake://auto", "--kv-store-config", EVICT]),
)


def run(label: str, server: list[str], args: argparse.Namespace, out: Path) -> dict:
    done = out.with_suffix(".json")
    if done.exists() and not args.fresh:
        print(f"== {label}: {done} (kept)", file=sys.stderr, flush=True)
        return json.loads(done.read_text())["variants"][0]["metrics"]
    cmd = [
        sys.executable, "-m", "radixserve.cli", "bench", "multi-turn",
        "--model", args.model,
        "--conversations", str(args.conversations),
        "--turns", str(args.turns),
        "--system-len", str(args.system_len),
        "--user-len-min", str(args.user_len_min),
        "--user-len-max", str(args.user_len_max),
        "--answer", args.answer,
        "--server-args", shlex.join([*shlex.split(args.server_args), *server]),
        "--output", str(out),
        "--no-plot", "--no-progress",
    ]  # fmt: skip
    print(f"== {label}: {shlex.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    doc = json.loads(out.with_suffix(".json").read_text())
    return doc["variants"][0]["metrics"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=0)
    p.add_argument("--user-len-min", type=int, default=128)
    p.add_argument("--user-len-max", type=int, default=256)
    p.add_argument("--answer", default="short")
    p.add_argument(
        "--server-args",
        default="--page-size 16",
        help="launch flags every variant shares (the pool should hold the working set: "
        "the replicas' own caches are then not what limits the hits)",
    )
    p.add_argument("--out", default="bench/results/kv_store_dp")
    p.add_argument("--fresh", action="store_true", help="run every variant again")
    args = p.parse_args()
    out = Path(args.out)
    metrics = {
        label: run(label, server, args, out.with_name(f"{out.name}-{i}"))
        for i, (label, server) in enumerate(VARIANTS)
    }
    rows = [
        ("hit rate", "hit_rate", "{:.1%}"),
        ("output tok/s", "output_tok_s", "{:.1f}"),
        ("requests/s", "request_throughput", "{:.3f}"),
        ("TTFT mean ms", "ttft_mean_ms", "{:.0f}"),
        ("duration s", "duration_s", "{:.1f}"),
        ("failed", "failed", "{:.0f}"),
    ]
    print(f"\n| metric | {' | '.join(metrics)} |")
    print("|---|" + "---:|" * len(metrics))
    for name, key, fmt in rows:
        print(f"| {name} | " + " | ".join(fmt.format(m[key]) for m in metrics.values()) + " |")
    one, rr, store, evict = (metrics[label] for label, _ in VARIANTS)
    print(
        f"\nhit rate: store {store['hit_rate']:.1%} vs one replica {one['hit_rate']:.1%} "
        f"({100 * (store['hit_rate'] - one['hit_rate']):+.1f} points); "
        f"without the store {rr['hit_rate']:.1%}"
    )
    print(
        f"output throughput, two replicas: store / no store = "
        f"{store['output_tok_s'] / rr['output_tok_s']:.2f}x "
        f"(written on eviction: {evict['output_tok_s'] / rr['output_tok_s']:.2f}x, "
        f"hit rate {evict['hit_rate']:.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
