"""Decode step time with CUDA graphs on vs off (``--disable-cuda-graph``), side by side.

    python bench/cuda_graphs.py --model-config qwen3 --batches 1,8,32,64 --context 512

Two ModelRunners of the same model on the same device (flashinfer under ``auto``
where it runs), one replaying decode graphs and one eager, take turns in rounds
(``bench/worker.py``'s ``interleaved``: the median over rounds of each side's
fastest step, and the median of the per-round ratios). The KV pool is filled with
random values, so no prefill is timed. Without CUDA (or where flashinfer is not
chosen) both sides run eagerly and the ratio is ~1: the table says which backend
ran and whether graphs were captured.
"""

from __future__ import annotations

import argparse
import tempfile

from worker import BENCH_CONFIGS, MAX_STEPS, interleaved, ints, ours_decode, random_model

from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-config", choices=sorted(BENCH_CONFIGS), default=None,
                    help="a random ~100M model of this family instead of --model")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens in KV per request")
    ap.add_argument("--steps", type=int, default=5, help="decode steps per side per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per batch size")
    args = ap.parse_args()
    if args.rounds * (args.steps + 1) >= MAX_STEPS:
        ap.error(f"rounds * (steps + 1) must stay below {MAX_STEPS}")
    if args.model_config:
        args.model = random_model(args.model_config, tempfile.mkdtemp(prefix="rs-bench-"))
    max_b = max(args.batches)
    pages = max_b * -(-(args.context + MAX_STEPS + 1) // args.page_size)
    runners = {
        off: build_runner(WorkerConfig(model=args.model, device=args.device, dtype=args.dtype,
                                      page_size=args.page_size, num_pages=pages,
                                      max_running_requests=max_b, disable_cuda_graph=off))
        for off in (False, True)
    }  # fmt: skip
    on = runners[False]
    print(f"model {on.model_name}, {args.device}, {args.dtype}, page_size {args.page_size}, "
          f"backend {on.backend_name}, graphs captured: "
          f"{list(on.graphs.sizes) if on.graphs else 'none'}")  # fmt: skip
    print(
        f"\n| {'decode step (ms)':<24} | {'graphs on':>9} | {'graphs off':>10} | {'speedup':>7} |"
    )
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 12}|{'-' * 9}|")
    for b in args.batches:
        t_on, t_off, ratio = interleaved(
            ours_decode(on, b, args.context), ours_decode(runners[True], b, args.context),
            args.rounds, args.steps,
        )  # fmt: skip
        name = f"b={b} ctx={args.context}"
        print(f"| {name:<24} | {t_on * 1e3:>9.2f} | {t_off * 1e3:>10.2f} | {ratio:>6.2f}x |")
    print("\nspeedup = graphs-off time / graphs-on time (median of per-round ratios)")


if __name__ == "__main__":
    main()
