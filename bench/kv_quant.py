"""Quantized KV pools (``--kv-cache-dtype``) on the embedded SmolLM2 with bfloat16 weights.

Two measurements, each one in-process Engine per KV dtype:

``--mode agreement`` (default): a few dozen chat prompts, greedy, the first
``--output-len`` tokens with logprobs. Per KV dtype: the share of prompts whose tokens
equal the bfloat16 pool's, the mean position of the first difference where they
differ, and the largest difference of a chosen token's logprob over the positions
where the two agree so far. The variant ``fp8_e4m3@1`` stores fp8 e4m3 with every
scale fixed at 1.0 (vLLM's default scale) instead of the row's max / 448: the
measurement behind the choice of per-row scales.

    python bench/kv_quant.py --mode agreement

``--mode decode``: the shared-prefix workload of ``bench/cached_decode.py`` (P prompts,
one S-token system prompt, Q-token questions, O output tokens, greedy): a first run
fills each engine's cache, then every round runs the prompts again on each engine in
turn (everything but the questions cached: one short prefill, then O - 1 decode steps
at batch P). The table gives per KV dtype the median decode step and its ratio to
the first dtype's within each round (median over rounds). ``--groups G`` spreads the
prompts over G system prompts (``--groups 32``: every request reads its own context).

    python bench/kv_quant.py --mode decode --prompts 32 --system-len 1000 --rounds 5
    python bench/kv_quant.py --mode decode --prompts 32 --groups 32 --system-len 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from radixserve.worker import kv_quant  # noqa: E402

SUBJECTS = [
    "the water cycle", "photosynthesis", "the French Revolution", "black holes",
    "the immune system", "machine learning", "the Roman Empire", "volcanoes",
    "the stock market", "climate change", "the printing press", "electric cars",
]  # fmt: skip
ASKS = [
    "Explain {} to a ten-year-old.",
    "Give three facts about {}.",
    "Write a short poem about {}.",
]


def chat_prompts(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        ask = ASKS[i % len(ASKS)].format(SUBJECTS[(i // len(ASKS)) % len(SUBJECTS)])
        out.append([{"role": "user", "content": ask}])
    return out


def fixed_scale_quantize(x: torch.Tensor, quant: kv_quant.Quant) -> torch.Tensor:
    """The pool's format with every scale 1.0: codes are x itself rounded to fp8."""
    codes = x.float().clamp(-quant.qmax, quant.qmax).to(quant.code_dtype)
    one = torch.ones(*x.shape[:-1], 1, dtype=torch.float16)
    return torch.cat([codes.view(torch.uint8), one.view(torch.uint8)], dim=-1)


def engine_for(name: str, args, **kw):
    from radixserve import Engine

    kv = name.split("@")[0]
    return Engine(model=args.model, dtype="bfloat16", kv_cache_dtype=kv,
                  kv_memory=args.kv_memory, **kw)  # fmt: skip


def agreement(args) -> None:
    from radixserve import SamplingParams

    prompts = chat_prompts(args.num_prompts)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, logprobs=1)
    names = args.kv_dtypes.split(",")
    runs = {}
    for name in names:
        original = kv_quant.quantize
        if name.endswith("@1"):
            # The torch backend looks the function up on its own module.
            from radixserve.worker.attention import torch_backend

            torch_backend.quantize = fixed_scale_quantize
        try:
            eng = engine_for(name, args)
            t = time.perf_counter()
            results = eng.generate(prompts, sp)
            runs[name] = (results, time.perf_counter() - t)
            eng.close()
            print(f"{name}: {runs[name][1]:.1f} s", file=sys.stderr, flush=True)
        finally:
            from radixserve.worker.attention import torch_backend

            torch_backend.quantize = original
    base = runs[names[0]][0]
    print(f"{len(prompts)} chat prompts, first {args.output_len} greedy tokens, SmolLM2 "
          f"bfloat16 weights, {torch.get_num_threads()} threads; against {names[0]}")  # fmt: skip
    print("| kv dtype | prompts equal | mean first difference | max logprob diff | seconds |")
    print("|---|---|---|---|---|")
    for name in names:
        results, secs = runs[name]
        equal, firsts, worst = 0, [], 0.0
        for a, b in zip(base, results):
            if a.token_ids == b.token_ids:
                equal += 1
            else:
                firsts.append(next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids))
                                   if x != y))  # fmt: skip
            for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
                if x != y:
                    break
                worst = max(worst, abs(a.logprobs[i].logprob - b.logprobs[i].logprob))
        first = f"{statistics.mean(firsts):.1f}" if firsts else "-"
        print(f"| {name} | {equal}/{len(base)} ({equal / len(base):.0%}) | {first} | "
              f"{worst:.4f} | {secs:.1f} |")  # fmt: skip


def decode(args) -> None:
    from radixserve import SamplingParams
    from radixserve.benchmark.workloads import TokenSource, shared_prefix
    from radixserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    src = TokenSource.random(len(tok), args.seed, exclude=tok.all_special_ids)
    per_group = -(-args.prompts // args.groups)
    work = shared_prefix(src, args.groups, per_group, args.system_len, args.question_len,
                         args.output_len)  # fmt: skip
    prompts = [node.tokens for node in work.roots][: args.prompts]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    names = args.kv_dtypes.split(",")
    engines, steps = {}, {}
    for name in names:
        eng = engine_for(name, args)
        times: list[float] = []
        run_step = eng.runner.step

        def timed(batch, run_step=run_step, times=times):
            t = time.perf_counter()
            out = run_step(batch)
            if batch.reqs and all(len(r.input_ids) == 1 for r in batch.reqs):
                times.append(time.perf_counter() - t)
            return out

        eng.runner.step = timed  # type: ignore[method-assign]
        eng.generate(prompts, sp)  # fills the cache
        engines[name], steps[name] = eng, times
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            steps[name].clear()
            engines[name].generate(prompts, sp)
            rounds[name].append(statistics.median(steps[name]))
    info = {name: engines[name].runner.info() for name in names}
    shared = "shared prefix" if args.groups == 1 else f"prefix in {args.groups} groups"
    print(f"{args.prompts} prompts x {args.system_len}-token {shared} + "
          f"{args.question_len}, {args.output_len} tokens, SmolLM2 bfloat16 weights, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| kv dtype | tokens per GiB | decode step ms | step time vs first |")
    print("|---|---|---|---|")
    base = rounds[names[0]]
    for name in names:
        ratio = statistics.median(r / b for b, r in zip(base, rounds[name]))
        print(f"| {name} | {info[name].tokens_per_gib} | "
              f"{statistics.median(rounds[name]) * 1e3:.1f} | {ratio:.2f}x |")  # fmt: skip
    for eng in engines.values():
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["agreement", "decode"], default="agreement")
    ap.add_argument("--kv-dtypes", default=None,
                    help="comma-separated; the first is the baseline")  # fmt: skip
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-memory", type=int, default=256 << 20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=36, help="agreement: chat prompts")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32, help="decode: batch")
    ap.add_argument("--groups", type=int, default=1,
                    help="decode: system prompts the batch is spread over (batch: none shared)")  # fmt: skip
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kv_dtypes is None:
        args.kv_dtypes = "bfloat16,int8,fp8_e4m3,fp8_e5m2"
        if args.mode == "agreement":
            args.kv_dtypes += ",fp8_e4m3@1"
    (agreement if args.mode == "agreement" else decode)(args)


if __name__ == "__main__":
    main()
