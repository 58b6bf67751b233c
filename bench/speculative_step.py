"""What a verification row costs beside a decode row, by batch size: where drafting stops paying.

Speculative decoding computes a request's last token and its k drafts as k + 1
query rows in one step. At batch 1 a decode step reads every weight for one row,
so the extra rows are nearly free; as the batch grows the step becomes bound by
compute and each row costs its share. This script builds a worker (``ModelRunner``)
on the model, prefills B requests of P tokens, then times, interleaved, plain decode
steps (one row each) and verification steps (1 + k rows each, ``num_drafts`` k,
random drafts: the verification rejects them, which costs the same work) at the same
positions, and prints per batch size the median step times, their ratio, and the
break-even: the accepted drafts per verification a drafted step needs to produce
tokens as fast as the plain one (``ratio - 1``). Drafting pays at a batch size when
the workload's tokens per verification exceed ``ratio``; ``--speculative-max-batch``
is set from where that stops holding (bench/results/speculative_step.md has the measurement).

    python bench/speculative_step.py --batches 1,2,4,8,16 --drafts 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=7, help="timed steps of each kind per batch")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from radixserve.protocol import Step, StepReq
    from radixserve.sampling_params import SamplingParams
    from radixserve.worker.build import build_runner
    from radixserve.worker.config import WorkerConfig

    batches = [int(b) for b in args.batches.split(",")]
    k, p, ps = args.drafts, args.prompt_len, 16
    per = -(-(p + k + 1) // ps)
    cfg = WorkerConfig(
        model=args.model, dtype=args.dtype, page_size=ps, num_pages=per * max(batches) + 1,
        max_running_requests=max(batches), chunked_prefill_size=p,
    )  # fmt: skip
    runner = build_runner(cfg)
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0)
    print(f"model {args.model} ({runner.dtype_name}), prompt {p}, {k} drafts, threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    print(f"{'batch':>5}  {'decode ms':>9}  {'verify ms':>9}  {'ratio':>6}  {'break-even':>10}")
    for b in batches:
        pages = [np.arange(s * per, (s + 1) * per, dtype=np.int32) for s in range(b)]
        for s in range(b):  # prefill each slot
            ids = rng.integers(10, runner.vocab_size, p).astype(np.int32)
            runner.step(Step([StepReq(s, ids, 0, pages[s], True, greedy)]))
        last = rng.integers(10, runner.vocab_size, (b, k + 1)).astype(np.int32)
        plain = Step([StepReq(s, last[s, :1], p, pages[s][:0], True) for s in range(b)])
        spec = Step([StepReq(s, last[s], p, pages[s][:0], True, num_drafts=k) for s in range(b)])
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        for _ in range(args.steps):
            for name, step in (("plain", plain), ("spec", spec)):
                t0 = time.perf_counter()
                runner.step(step)
                times[name].append(time.perf_counter() - t0)
        a, v = statistics.median(times["plain"]), statistics.median(times["spec"])
        print(f"{b:>5}  {a * 1e3:>9.1f}  {v * 1e3:>9.1f}  {v / a:>6.2f}  {v / a - 1:>10.2f}")
        runner.step(Step([], release=np.arange(b, dtype=np.int32)))


if __name__ == "__main__":
    main()
