"""SmolLM2 in bf16: the flashinfer backend against the torch backend on the same GPU.

    python bench/gpu_parity.py [--page-sizes 1,16 --new-tokens 64]
    python bench/gpu_parity.py --device cpu --candidate torch --new-tokens 4   # plumbing only

Four chat prompts (a shared ~80-token system message and a question each: every prompt
is over 64 tokens) run through ModelRunners as the server runs them: the first prompt
alone, then the other three with the first one's whole prefix pages as their cached
prefix (they compute only from there), then decode steps of all four together.
Runners, per page size: ``t32`` (torch backend, float32: the reference), ``t16`` (torch
backend, bf16) and the candidate (flashinfer, bf16) with CUDA graphs on and off.

1. Greedy text: ``t16`` generates ``--new-tokens`` tokens per prompt greedily; each
   candidate generates on its own (free running) too.
2. Teacher-forced: every runner is fed ``t16``'s tokens, and its logits at every
   generated position (prefill's last row, then each decode step) are kept.

Tolerance, derived in the run rather than fixed: bf16 keeps 8 significant bits, and two
correct bf16 implementations that round in different places each differ from the float32
result by about the same amount. ``e16 = max |t16 - t32|`` measures that for this model
and these prompts. The candidate passes when
- ``max |cand - t32| <= 2 * e16`` (no worse than twice the torch backend's own bf16 error);
  then ``max |cand - t16| <= 3 * e16`` follows, and is printed;
- its free-running greedy text equals ``t16``'s up to a token where the teacher-forced
  candidate also picks another token than ``t16`` (the contexts are the same until
  then, so the free run must reproduce the forced one; from there they part);
- with CUDA graphs asked for, graphs were captured.
Within the bound every top-1 disagreement is a near tie (``t32``'s logits of the two
tokens within ``2 * max(|cand - t32|, e16)``); each is printed with that gap, and the
top-1 agreement rate is reported.
Exit status 0 when every candidate passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.models.tokenizer import load_tokenizer
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig

GREEDY = SamplingParams(temperature=0)
SYSTEM = (
    "You are a careful assistant for a small engineering team. Answer in one or two short "
    "sentences, plainly, without lists or headings. If a question has a single well-known "
    "answer, give that answer first and then at most one sentence of context. Do not repeat "
    "the question, do not apologise, and do not mention that you are an assistant."
)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "What does a compiler do?",
]


@dataclass
class Run:
    """What one runner gave: tokens per prompt and (teacher-forced) logits per position."""

    tokens: list[list[int]] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [prompts, new_tokens, vocab] float32, CPU


def prompt_ids(tokenizer) -> list[np.ndarray]:
    out = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
        out.append(ids)
    return out


def shared_len(prompts: list[np.ndarray]) -> int:
    n = min(len(p) for p in prompts)
    first = prompts[0][:n]
    for p in prompts[1:]:
        n = min(n, int(np.argmax(p[:n] != first[:n])) if (p[:n] != first[:n]).any() else n)
    return n


def run(runner, prompts: list[np.ndarray], new_tokens: int, forced: list[list[int]] | None) -> Run:
    """Prompt 0 fresh, the others after its cached prefix pages, then decode steps of all;
    greedy (``forced`` None) or fed ``forced``'s tokens."""
    ps = runner.page_size
    n = len(prompts)
    cached = shared_len(prompts) // ps * ps  # whole pages of the shared prefix
    need = [-(-(len(p) + new_tokens + 1) // ps) for p in prompts]
    tables, nxt = [], 0
    for i in range(n):
        own = np.arange(nxt, nxt + need[i] - (cached // ps if i else 0), dtype=np.int32)
        nxt += len(own)
        tables.append(own if i == 0 else np.concatenate([tables[0][: cached // ps], own]))
    held = [0] * n
    pos = [0] * n

    def req(i: int, ids: np.ndarray, start: int, sample: SamplingParams | None) -> StepReq:
        upto = -(-(start + len(ids)) // ps)
        r = StepReq(i, ids.astype(np.int32), start, tables[i][held[i] : upto], True, sample)
        held[i] = upto
        pos[i] = start + len(ids)
        return r

    out = Run(tokens=[[] for _ in range(n)])
    rows: list[torch.Tensor] = []
    first = runner.forward_logits(Step([req(0, prompts[0], 0, GREEDY)]))
    # The others after slot 0 wrote the prefix: their tables begin with its pages.
    rest = [req(i, prompts[i][cached:], cached, GREEDY) for i in range(1, n)]
    last = torch.cat([first, runner.forward_logits(Step(rest))]).float()
    for k in range(new_tokens):
        rows.append(last.cpu())
        chosen = last.argmax(-1).cpu().numpy()
        if forced is not None:
            chosen = np.array([forced[i][k] for i in range(n)])
        for i in range(n):
            out.tokens[i].append(int(chosen[i]))
        if k + 1 == new_tokens:
            break
        step = Step([req(i, np.array([chosen[i]]), pos[i], None) for i in range(n)])
        last = runner.forward_logits(step).float()
    runner.step(Step([], release=list(range(n))))
    out.logits = torch.stack(rows, 1)
    return out


def build(args, page_size: int, backend: str, dtype: str, graphs: bool):
    return build_runner(WorkerConfig(
        model=args.model, device=args.device, dtype=dtype, page_size=page_size,
        num_pages=4096 // page_size + 64, max_running_requests=8, attention_backend=backend,
        disable_cuda_graph=not graphs, flashinfer_prefill_backend=args.prefill_backend,
        warmup=backend != "torch",
    ))  # fmt: skip


def compare(name: str, cand: Run, forced: Run, t16: Run, t32: Run, e16: float) -> bool:
    """The candidate's checks (see the module's docstring): ``cand`` its free-running
    run, ``forced`` its run fed ``t16``'s tokens. Prints a line, and one per top-1
    disagreement."""
    d16 = (forced.logits - t16.logits).abs()  # teacher-forced candidate vs t16
    err32 = float((forced.logits - t32.logits).abs().max())
    top_c, top_t = forced.logits.argmax(-1), t16.logits.argmax(-1)
    agree = float((top_c == top_t).float().mean())
    # Within the bounds, a disagreement can only be a near tie: t32's two logits within
    # 2 * max(err32, e16). Printed, so that a failing bound shows where it bit.
    for p, k in (top_c != top_t).nonzero().tolist():
        a, b = int(top_c[p, k]), int(top_t[p, k])
        gap = float((t32.logits[p, k, a] - t32.logits[p, k, b]).abs())
        print(f"   top-1 differs: prompt {p} token {k}: t32 gap {gap:.4f}")
    # Free-running greedy text: equal to t16's up to a token where the teacher-forced
    # candidate disagrees too (the same contexts so far, so the same logits); the
    # contexts part there.
    text_ok = True
    for p in range(len(t16.tokens)):
        differ = [k for k, (c, t) in enumerate(zip(cand.tokens[p], t16.tokens[p])) if c != t]
        if differ and top_c[p, differ[0]] == top_t[p, differ[0]]:
            text_ok = False
            print(f"   greedy text of prompt {p} parts at token {differ[0]}, where the "
                  "teacher-forced run agrees")  # fmt: skip
    ok = err32 <= 2 * e16 and text_ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max|cand-t32| {err32:.4f} (<= 2*e16 {2 * e16:.4f}), "
          f"max|cand-t16| {float(d16.max()):.4f}, top-1 agreement {agree:.2%}, greedy text "
          f"{'equal' if all(c == t for c, t in zip(cand.tokens, t16.tokens)) else 'parts at a near tie' if text_ok else 'differs'}")  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--candidate", default="flashinfer", help="the bf16 backend checked")
    ap.add_argument("--prefill-backend", default="fa2", help="flashinfer prefill: fa2, auto")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    prompts = prompt_ids(tokenizer)
    cached = shared_len(prompts)
    print(f"prompts of {[len(p) for p in prompts]} tokens, {cached} shared; "
          f"{args.new_tokens} new tokens each")  # fmt: skip
    if min(len(p) for p in prompts) <= 64:
        raise SystemExit("the prompts must be over 64 tokens")
    passed = True
    for ps in (int(x) for x in args.page_sizes.split(",")):
        t = time.perf_counter()
        t32r = build(args, ps, "torch", "float32", graphs=False)
        t16r = build(args, ps, "torch", "bfloat16", graphs=False)
        t16 = run(t16r, prompts, args.new_tokens, None)  # greedy: its logits are forced ones
        t32 = run(t32r, prompts, args.new_tokens, t16.tokens)
        del t32r, t16r
        e16 = float((t16.logits - t32.logits).abs().max())
        print(f"\n== page size {ps}: e16 = max|t16-t32| = {e16:.4f} "
              f"(cached prefix {cached // ps * ps} tokens)")  # fmt: skip
        for graphs in (True, False):
            runner = build(args, ps, args.candidate, "bfloat16", graphs)
            name = f"{runner.backend_name} bf16, graphs {'on' if runner.graphs else 'off'}"
            free = run(runner, prompts, args.new_tokens, None)
            forced = run(runner, prompts, args.new_tokens, t16.tokens)
            passed &= compare(name, free, forced, t16, t32, e16)
            if graphs and args.device.startswith("cuda") and runner.graphs is None:
                print(f"FAIL {name}: CUDA graphs were asked for but not captured")
                passed = False
            del runner
        print(f"   page size {ps}: {time.perf_counter() - t:.1f} s")
    text = tokenizer.decode(t16.tokens[0], skip_special_tokens=True)
    print(f"\nt16 greedy answer to {QUESTIONS[0]!r}: {text!r}")
    print(f"\nparity: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    sys.exit(main())
