"""Quantized KV pools (``--kv-cache-dtype``) on the embedded SmolLM2 with bfloat16 weights.

Two measurements, each one in-process Engine per KV dtype:

``--mode agreement`` (default): a few dozen chat prompts, greedy, the first
``--output-len`` tokens with logprobs, all prompts in one batch. Per KV dtype, against
the first (the bfloat16 pool):

- free-running: the share of prompts whose tokens equal the reference's, and the
  mean position of the first difference where they differ;
- teacher-forced: every engine scores the reference's own tokens (prompt + the
  reference's completion as one prompt, ``prompt_logprobs``, the cache flushed
  first), so a difference at one position does not change the next. The share of
  positions whose most likely token is the reference's, the share of prompts where
  all are, the share of positions whose most likely token is the one the reference
  pool's own scoring picks (the KV format alone), and the largest difference of the
  reference token's logprob against the reference pool's own teacher-forced logprob.

Rows beside the formats give the floor any change of rounding sets:
``bfloat16@rev`` is the bfloat16 pool with the batch in reverse order, ``float32``
a pool more precise than the reference. The variant ``fp8_e4m3@1`` stores fp8 e4m3
with every scale fixed at 1.0 (vLLM's default scale) instead of the row's max / 448.
``near ties`` counts the reference's prompts whose greedy path passes a position
where its two most likely tokens are closer than ``--tie`` nats.

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
                  kv_memory=args.kv_memory, deterministic=args.deterministic, **kw)  # fmt: skip


def agreement(args) -> None:
    from radixserve import SamplingParams

    chats = chat_prompts(args.num_prompts)
    names = args.kv_dtypes.split(",")
    free_sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True,
                             logprobs=2)  # fmt: skip
    ref: list | None = None
    rows = {}
    for name in names:
        original = kv_quant.quantize
        from radixserve.worker.attention import torch_backend

        if name.endswith("@1"):
            # The torch backend looks the function up on its own module.
            torch_backend.quantize = fixed_scale_quantize
        try:
            eng = engine_for(name, args)
            ids = [eng._to_ids(c, None) for c in chats]
            order = list(range(len(ids)))[:: -1 if name.endswith("@rev") else 1]
            t = time.perf_counter()
            got = eng.generate([ids[i] for i in order], free_sp)
            free = [None] * len(ids)
            for i, r in zip(order, got):
                free[i] = r
            if ref is None:
                ref = free
            eng.flush_cache()
            forced = eng.generate(
                [ids[i] + ref[i].token_ids for i in order],
                [SamplingParams(max_tokens=0, prompt_logprobs=1, logprob_start_len=len(ids[i]))
                 for i in order],
            )  # fmt: skip
            scored = [None] * len(ids)
            for i, r in zip(order, forced):
                scored[i] = r.prompt_logprobs[len(ids[i]) :]
            rows[name] = (free, scored, time.perf_counter() - t)
            eng.close()
            print(f"{name}: {rows[name][2]:.1f} s", file=sys.stderr, flush=True)
        finally:
            torch_backend.quantize = original
    assert ref is not None
    base_scored = rows[names[0]][1]
    n = len(ref)
    ties = sum(
        any(lp.top[0].logprob - lp.top[1].logprob < args.tie for lp in r.logprobs) for r in ref
    )
    print(f"{n} chat prompts, first {args.output_len} greedy tokens, SmolLM2 bfloat16 "
          f"weights, {torch.get_num_threads()} threads; against {names[0]}; near ties "
          f"(top-2 gap < {args.tie} nats): {ties}/{n} prompts")  # fmt: skip
    print("| kv dtype | free-running: prompts equal | first difference (mean) | "
          "teacher-forced: positions equal | prompts equal | argmax as the reference's | "
          "max logprob diff | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        free, scored, secs = rows[name]
        equal, firsts = 0, []
        for a, b in zip(ref, free):
            if a.token_ids == b.token_ids:
                equal += 1
            else:
                firsts.append(next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids))
                                   if x != y))  # fmt: skip
        pos_equal = prompts_equal = same_argmax = 0
        worst = 0.0
        for a, got, base in zip(ref, scored, base_scored):
            hits = [lp.top[0].token_id == t for lp, t in zip(got, a.token_ids)]
            pos_equal += sum(hits)
            prompts_equal += all(hits)
            same_argmax += sum(x.top[0].token_id == y.top[0].token_id for x, y in zip(got, base))
            worst = max(worst, *(abs(x.logprob - y.logprob) for x, y in zip(got, base)))
        first = f"{statistics.mean(firsts):.1f}" if firsts else "-"
        total = sum(len(a.token_ids) for a in ref)
        print(f"| {name} | {equal}/{n} ({equal / n:.0%}) | {first} | "
              f"{pos_equal / total:.2%} | {prompts_equal}/{n} | {same_argmax / total:.2%} | "
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
    ap.add_argument("--tie", type=float, default=0.1, help="agreement: a near tie, in nats")
    ap.add_argument("--deterministic", action="store_true", help="engines in --deterministic mode")
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
            args.kv_dtypes = "bfloat16,bfloat16@rev,float32,int8,fp8_e4m3,fp8_e5m2,fp8_e4m3@1"
    (agreement if args.mode == "agreement" else decode)(args)


if __name__ == "__main__":
    main()
