"""What an overlap scheduler could hide: the scheduler's own time per step beside the worker's.

An overlap scheduler (SGLang's) plans step k+1 and processes step k - 1's
results while the worker computes step k, so at best it hides the scheduler's
own time per step: planning, processing a result, and, when served, encoding the
``Step`` and decoding the ``StepResult`` (plus the worker's decode/encode of the
same messages, and the ``Outputs`` message to the tokenizer). This script runs
the shared-prefix workload of ``bench/engine_trials.py`` (G groups of P prompts,
S-token system prompts, Q-token questions, O output tokens, greedy, ``ignore_eos``)
through one in-process Engine, whose loop is the scheduler process's loop without
the sockets, and times with ``time.perf_counter``:

- worker: ``runner.step`` (the forward pass and sampling);
- scheduler: the rest of ``Scheduler.step`` (plan + result processing);
- messages: encode + decode of the step's ``Step``, ``StepResult`` and ``Outputs``
  (done here on the side, outside both figures, as the processes would).

Trials flush the cache first (prefill steps included), then one all-cached repeat;
the table gives per kind of step (decode-only steps at the full batch, others) the
median milliseconds of each part and the scheduler + messages share of a step.

    python bench/step_overlap.py --groups 4 --prompts 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve import protocol as P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="per group")
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=30)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from radixserve import Engine, SamplingParams
    from radixserve.benchmark.workloads import TokenSource, shared_prefix
    from radixserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    src = TokenSource.random(len(tok), args.seed, exclude=tok.all_special_ids)
    work = shared_prefix(
        src, args.groups, args.prompts, args.system_len, args.question_len, args.output_len
    )
    prompts = [node.tokens for node in work.roots]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine = Engine(model=args.model)
    engine.generate(prompts[:2], sp)  # warm the code paths
    full = len(prompts)
    # per step: (decode-only at full batch?, worker s, scheduler s, messages s)
    steps: list[tuple[bool, float, float, float]] = []
    sched_step = engine.scheduler.step

    def timed_step(run):
        worker = [0.0, 0.0, False]  # worker seconds, message seconds, full decode

        def timed_run(batch):
            t = time.perf_counter()
            P.decode(batch.encode(), {P.Step.TYPE: P.Step})
            t1 = time.perf_counter()
            result = run(batch)
            t2 = time.perf_counter()
            P.decode(result.encode(), {P.StepResult.TYPE: P.StepResult})
            worker[0] = t2 - t1
            worker[1] += (t1 - t) + (time.perf_counter() - t2)
            worker[2] = len(batch.reqs) == full and all(len(r.input_ids) == 1 for r in batch.reqs)
            return result

        t = time.perf_counter()
        outputs = sched_step(timed_run)
        total = time.perf_counter() - t
        if worker[0]:
            t = time.perf_counter()
            P.decode(P.Outputs(outputs).encode(), {P.Outputs.TYPE: P.Outputs})
            messages = worker[1] + time.perf_counter() - t
            steps.append((bool(worker[2]), worker[0], total - worker[0] - worker[1], messages))
        return outputs

    engine.scheduler.step = timed_step  # type: ignore[method-assign]
    for _ in range(args.trials):
        engine.flush_cache()
        engine.generate(prompts, sp)
    engine.generate(prompts, sp)  # all cached
    engine.close()
    print(f"{args.groups} groups x {args.prompts} prompts, {args.system_len}-token system "
          f"prompts, {args.output_len} tokens, {torch.get_num_threads()} threads, "
          f"{args.trials} flushed trials + 1 all-cached repeat")  # fmt: skip
    print(
        "| steps | count | worker ms | scheduler ms | messages ms | (scheduler + messages) / step |"
    )
    print("|---|---|---|---|---|---|")
    for name, pick in (("decode, full batch", True), ("other (prefill, mixed)", False)):
        rows = [s for s in steps if s[0] == pick]
        if not rows:
            continue
        w, s, m = (statistics.median(r[i] for r in rows) for i in (1, 2, 3))
        print(f"| {name} | {len(rows)} | {w * 1e3:.2f} | {s * 1e3:.2f} | {m * 1e3:.2f} | "
              f"{(s + m) / (w + s + m):.1%} |")  # fmt: skip
    w, s, m = (sum(r[i] for r in steps) for i in (1, 2, 3))
    print(f"| all, summed | {len(steps)} | {w * 1e3:.0f} | {s * 1e3:.0f} | {m * 1e3:.0f} | "
          f"{(s + m) / (w + s + m):.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
