"""Prefill/decode disaggregation against one server of the same cores
(docs/scale-out.md#prefilldecode-disaggregation).

Two runs of ``radixserve bench``, each against servers launched here:

1. a long-prompt, long-output mix (``shared-prefix``: its prompts share a system
   prompt per group) through ``radixserve launch --pd 1,1`` (``--threads`` half the
   cores each) and through one server with all the cores: TTFT and ITL (mean, p99)
   side by side, and the KV bytes the pair moved between its workers, beside what a
   transfer of every prompt page would have moved (the pages the decode server held
   were never sent: sent + skipped);
2. a multi-turn workload through the pair (a chat: a system prompt, short user
   messages and answers), whose decode server holds each conversation's history:
   the share of prompt pages not transferred.

    python bench/pd_disagg.py --model smollm2 --cores 2 --prompts 4 --system-len 2000 \\
        --output-len 128
    python bench/pd_disagg.py --only-multi-turn --conversations 2 --turns 6

Durations on a shared machine move between runs: compare the two rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from radixserve.client import Client  # noqa: E402


def launch(model: str, flags: list[str]) -> tuple[subprocess.Popen, str, str | None]:
    """A launched server (or --pd pair): the process, its endpoint, the decode server's."""
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--model", model, "--port", "0",
           "--log-level", "warning", "--exit-with-parent", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    endpoint, decode = "", None
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"serving on (\S+)", line):
            endpoint = m.group(1)
        elif m := re.search(r"decode servers \(\w+\): \S+ (\S+)", line):
            decode = m.group(1)
        elif "processes" in line:
            break
    if not endpoint:
        raise SystemExit(f"the server did not start (exit code {proc.wait()})")
    return proc, endpoint, decode


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(model: str, endpoint: str, workload: list[str], out: Path) -> dict:
    """``radixserve bench`` against ``endpoint``: its metrics."""
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", *workload, "--endpoint", endpoint,
           "--model", model, "--output", str(out), "--no-plot", "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return json.loads(Path(f"{out}.json").read_text())["variants"][0]["metrics"]


def transfer_stats(endpoint: str) -> dict:
    with Client(endpoint, timeout=60) as c:
        return {k: v for k, v in c.stats().items() if k.startswith("kv_transfer")}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="cores in all")
    p.add_argument("--server-args", default="", help="launch flags of every server")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4, help="shared-prefix: prompts per group")
    p.add_argument("--system-len", type=int, default=2000)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=2, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=6, help="multi-turn: turns each")
    p.add_argument("--mt-system-len", type=int, default=512, help="multi-turn: system prompt")
    p.add_argument("--mt-user-len", default="32,64", help="multi-turn: user messages' lengths")
    p.add_argument("--mt-output-len", type=int, default=32, help="multi-turn: answers")
    p.add_argument("--only-multi-turn", action="store_true", help="skip the long-prompt mix")
    p.add_argument(
        "--transfer-timeout",
        type=float,
        default=600.0,
        help="the pair's --kv-transfer-timeout: long prompts on loaded CPUs take a while, "
        "and a pull that times out is prefilled by the decode server (counted below)",
    )
    args = p.parse_args()
    extra = args.server_args.split()
    half = max(1, args.cores // 2)
    pair = ["--pd", "1,1", "--threads", str(half)]
    pair += ["--kv-transfer-timeout", str(args.transfer_timeout)]
    mix = ["shared-prefix", "--groups", str(args.groups), "--prompts", str(args.prompts),
           "--system-len", str(args.system_len), "--question-len", str(args.question_len),
           "--output-len", str(args.output_len), "--max-concurrency",
           str(args.max_concurrency), "--warmup", "0"]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    variants = [
        (f"one server, --threads {args.cores}", ["--threads", str(args.cores)]),
        (f"--pd 1,1, --threads {half} each", pair),
    ]
    rows = []
    for label, flags in [] if args.only_multi_turn else variants:
        proc, endpoint, decode = launch(args.model, [*flags, *extra])
        try:
            metrics = bench(args.model, endpoint, mix, tmp / label.split(",")[0].replace(" ", "_"))
            moved = transfer_stats(decode) if decode else None
        finally:
            stop(proc)
        rows.append((label, metrics, moved))

    if rows:
        report_mix(args, mix, rows)
    user_min, user_max = args.mt_user_len.split(",")
    turns = ["multi-turn", "--conversations", str(args.conversations), "--turns",
             str(args.turns), "--system-len", str(args.mt_system_len), "--user-len-min",
             user_min, "--user-len-max", user_max, "--output-len", str(args.mt_output_len),
             "--warmup", "0"]  # fmt: skip
    proc, endpoint, decode = launch(args.model, [*pair, *extra])
    try:
        bench(args.model, endpoint, turns, tmp / "multi_turn")
        moved = transfer_stats(decode)  # type: ignore[arg-type]
    finally:
        stop(proc)
    sent, skipped = moved["kv_transfer_pages_sent"], moved["kv_transfer_pages_skipped"]
    share = skipped / (sent + skipped) if sent + skipped else 0.0
    print(f"\n{' '.join(turns)} through --pd 1,1: {sent} prompt pages sent, {skipped} held by "
          f"the decode server: {share:.1%} not transferred "
          f"({moved['kv_transfer_fallbacks']} prefilled by the decode server)")  # fmt: skip


def report_mix(args: argparse.Namespace, mix: list[str], rows: list) -> None:
    """The long-prompt mix's table: latencies side by side, then the KV the pair moved."""
    print(f"\n{' '.join(mix)} (output {args.output_len} tokens), {args.cores} cores in all\n")
    print("| servers | TTFT mean ms | TTFT p99 ms | ITL mean ms | ITL p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for label, m, _ in rows:
        print(f"| {label} | {ms(m['ttft_mean_ms'])} | {ms(m['ttft_p99_ms'])} | "
              f"{ms(m['itl_mean_ms'])} | {ms(m['itl_p99_ms'])} | {m['output_tok_s']:.1f} |")  # fmt: skip
    base, pd = rows[0][1], rows[1][1]
    if base["itl_p99_ms"] and pd["itl_p99_ms"]:
        print(f"\nITL p99: pair / one server = {pd['itl_p99_ms'] / base['itl_p99_ms']:.2f}x; "
              f"TTFT p99: {pd['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x")  # fmt: skip
    moved = rows[1][2] or {}
    sent, skipped = (
        moved.get("kv_transfer_bytes_sent", 0),
        moved.get("kv_transfer_bytes_skipped", 0),
    )
    print("\n| KV between the workers | pages | MiB |")
    print("|---|---|---|")
    print(f"| sent (the decode server's match first) | {moved.get('kv_transfer_pages_sent', 0)} | "
          f"{sent / 2**20:.2f} |")  # fmt: skip
    whole = moved.get("kv_transfer_pages_sent", 0) + moved.get("kv_transfer_pages_skipped", 0)
    print(
        f"| every prompt page (no decode-side match) | {whole} | {(sent + skipped) / 2**20:.2f} |"
    )
    print(
        f"\npulls {moved.get('kv_transfer_pulls', 0)}, timed out "
        f"{moved.get('kv_transfer_timeouts', 0)}, prefilled by the decode server "
        f"{moved.get('kv_transfer_fallbacks', 0)}; pull latency mean "
        f"{moved.get('kv_transfer_latency_mean', 0):.2f} s, p99 "
        f"{moved.get('kv_transfer_latency_p99', 0):.2f} s"
    )


if __name__ == "__main__":
    main()
