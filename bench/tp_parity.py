"""Tensor parallelism against one rank on a real model: greedy tokens of the demo's chat
prompts and the first step's logits, TP=N vs TP=1, same dtype.

    python bench/tp_parity.py --tp 3                  # the embedded SmolLM2, float32
    python bench/tp_parity.py --model DIR --tp 2 --max-tokens 64

Prints, per prompt, whether the greedy tokens are identical (and where they first
differ), and the largest absolute difference between the two first-step logit rows
(prefill of the whole prompt, computed with ``forward_logits``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from radixserve import Engine, SamplingParams
from radixserve.demo import QUESTIONS, SYSTEM
from radixserve.protocol import Step, StepReq


def first_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The logits after prefilling ``ids`` in slot 0 (pages 0..), then the slot released."""
    runner = engine.runner
    pages = np.arange(-(-len(ids) // runner.page_size), dtype=np.int32)
    req = StepReq(0, np.asarray(ids, np.int32), 0, pages, True, SamplingParams(temperature=0))
    logits = runner.forward_logits(Step([req]))[0].clone()
    runner.step(Step([], release=[0]))
    return logits


def run(tp: int, args) -> tuple[list[list[int]], list[torch.Tensor], list[str]]:
    engine = Engine(args.model, dtype=args.dtype, tp=tp, num_pages=args.num_pages)
    try:
        chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                 for q in QUESTIONS]  # fmt: skip
        prompts = [engine.inputs.to_ids(messages=c) for c in chats]
        logits = [first_logits(engine, p) for p in prompts]  # before the cache holds them
        engine.flush_cache()
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        results = engine.generate(chats, sp)
        return [r.token_ids for r in results], logits, [r.text for r in results]
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-pages", type=int, default=2048)
    args = ap.parse_args()
    one = run(1, args)
    many = run(args.tp, args)
    print("\n| prompt | tokens | identical | first difference | max abs logit diff |")
    print("|---|---|---|---|---|")
    for q, a, b, la, lb in zip(QUESTIONS, one[0], many[0], one[1], many[1]):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        gap = float((la.double() - lb.double()).abs().max())
        print(f"| {q} | {len(a)} | {a == b} | {'-' if diff is None else diff} | {gap:.2e} |")
    for q, text in zip(QUESTIONS, many[2]):
        print(f"\ntp={args.tp}: {q}\n  {text.strip()}")


if __name__ == "__main__":
    main()
