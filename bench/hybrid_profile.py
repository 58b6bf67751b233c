"""Where a hybrid model's step goes: a prefill and decode steps of a random-weight
Qwen3.5 (gated delta-net) or Nemotron-H (Mamba-2) model through the ModelRunner,
each step's time split by what ran.

The model is saved as an HF folder (transformers' config class, its own random
init) and served by a ``ModelRunner`` (no scheduler): one request's prompt of
``--prefill`` tokens in one step, its recurrent state saved as a snapshot; then for
each batch size B, B slots start from that snapshot on the prompt's pages (the
prefix cache's hit) and decode ``--steps`` tokens together after two warm-up
steps. Every function below is timed by a wrapper that keeps its own time (its
time less that of the timed functions it calls), so the parts add up to the
step; what no wrapper covers (embedding, gates, sampling, Python between them) is
the rest.

    python bench/hybrid_profile.py --family qwen3_5 --dtype bfloat16
    python bench/hybrid_profile.py --family nemotron_h --dtype float32 --threads 2

``--ab R`` then times each batch's decode steps R more times with the delta rule's
native decode kernel off and on in turn (``gated_delta.NATIVE``, ``mamba2.NATIVE``) and
prints the median step time of each and their ratio (median of the rounds' ratios);
before that it times the prefill R times with the chunked forms' ``flush_exp`` replaced
by a plain ``exp`` and as they are, in turn (subnormal factors: docs/models.md).

``--cprofile N`` prints cProfile's N functions with most own time for a B=8 decode.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from radixserve import SamplingParams
from radixserve.layers import cpu_kernels
from radixserve.layers.linear import Linear
from radixserve.layers.parallel import ParallelLMHead, RowParallelLinear
from radixserve.models import blocks, gated_delta, hybrid, mamba2, nemotron_h
from radixserve.protocol import Step, StepReq
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig

PAGE = 16
FLUSH_EXP = gated_delta.flush_exp


def plain_exp(x: torch.Tensor) -> torch.Tensor:
    return x.exp()


#: Dims of the models built: Qwen3.5's small models' widths (hidden 1024, 16 key and
#: 16 value heads of 128 in the delta-net layers, 8 query / 2 KV heads of 256 in the
#: gated attention, three delta-net layers to one attention layer); Nemotron-H's
#: Mamba-2 layers as its released models (heads of 64, 8 groups, state 128).
DIMS = {
    "qwen3_5": dict(
        hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, vocab_size=32768, max_position_embeddings=8192,
    ),
    "nemotron_h": dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, mamba_num_heads=32, mamba_head_dim=64,
        n_groups=8, ssm_state_size=128, conv_kernel=4, vocab_size=32768,
        max_position_embeddings=8192,
    ),
}  # fmt: skip


def build(folder: Path, family: str, layers: int) -> Path:
    import transformers

    dims = dict(DIMS[family], num_hidden_layers=layers)
    if family == "qwen3_5":
        dims["layer_types"] = [
            "full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
        ]
        cfg = transformers.Qwen3_5TextConfig(**dims)
    else:  # Mamba, MLP pairs with one attention layer in the middle, as Nemotron-H
        pattern = ["M", "-"] * (layers // 2)
        pattern[len(pattern) // 2] = "*"
        cfg = transformers.NemotronHConfig(hybrid_override_pattern="".join(pattern), **dims)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


class Timer:
    """Own time per part: a wrapped call's time less its timed callees'."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # time of timed callees, per open call

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = self.stack.pop()
                self.own[part] += dt - inner
                if self.stack:
                    self.stack[-1] += dt

        setattr(owner, name, timed)


def instrument(timer: Timer) -> None:
    w = timer.wrap
    w(ParallelLMHead, "forward", "LM head")
    w(Linear, "forward", "projections (Linear)")
    w(RowParallelLinear, "forward", "projections (Linear)")
    w(gated_delta, "recurrent_step", "delta rule")
    w(gated_delta, "chunked", "delta rule")
    w(cpu_kernels, "gated_delta_step", "delta rule")
    w(mamba2, "recurrent_step", "Mamba-2 scan")
    w(mamba2, "chunked", "Mamba-2 scan")
    w(cpu_kernels, "mamba2_step", "Mamba-2 scan")
    for mod in (hybrid, nemotron_h):
        w(mod, "causal_conv", "causal conv")
        w(mod, "conv_step", "causal conv")
    w(hybrid.GatedDeltaNet, "_qkv", "q/k L2 norm, split")
    w(hybrid.GatedDeltaNet, "forward", "recurrent glue (gates, state gather/scatter)")
    w(nemotron_h.Mamba2Mixer, "forward", "recurrent glue (gates, state gather/scatter)")
    w(nemotron_h.Mamba2Mixer, "_split", "recurrent glue (gates, state gather/scatter)")
    w(hybrid.GatedRMSNorm, "forward", "norms")
    w(nemotron_h.GroupGatedRMSNorm, "forward", "norms")
    for name in ("forward", "layer_input", "add_norm"):
        w(blocks.RMSNorm, name, "norms")
    w(hybrid.GatedAttention, "forward", "full attention (with rotary, q/k norms)")
    w(nemotron_h.NoRopeAttention, "forward", "full attention (with rotary, q/k norms)")
    w(blocks.MLP, "forward", "MLP activation")
    w(nemotron_h.SquaredReluMLP, "forward", "MLP activation")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(DIMS), default="qwen3_5")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    ap.add_argument("--model", help="an existing folder instead of a new model")
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--ab", type=int, default=0, help="rounds of torch vs native decode")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.model) if args.model else build(Path(tmp.name), args.family, args.layers)

    prompt_pages = -(-args.prefill // PAGE)
    decode_pages = -(-(args.steps * (2 * args.ab + 2) + 4) // PAGE)
    num_pages = prompt_pages + max(batches) * decode_pages + 1
    runner = build_runner(
        WorkerConfig(model=str(folder), dtype=args.dtype, page_size=PAGE, num_pages=num_pages,
                     max_running_requests=max(batches) + 1, state_snapshots=1, warmup=False)
    )  # fmt: skip
    timer = Timer()
    instrument(timer)
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, 30000, args.prefill).astype(np.int32)
    table: list[tuple[str, float, dict[str, float]]] = []
    ab: list[tuple[int, float, float, float]] = []  # B, torch ms, native ms, ratio

    def timed_steps(label: str, steps: list[Step]) -> None:
        timer.own.clear()
        t0 = time.perf_counter()
        for s in steps:
            runner.step(s)
        total = (time.perf_counter() - t0) / len(steps)
        parts = {k: v / len(steps) for k, v in timer.own.items()}
        table.append((label, total, parts))

    # The prompt in one step (the slot's whole prefill), its state kept as snapshot 0.
    req = StepReq(0, prompt, 0, np.arange(prompt_pages, dtype=np.int32), True, greedy,
                  prompt_len=args.prefill, state_save_at=args.prefill, state_save=0)  # fmt: skip
    runner.step(Step([req]))  # warm-up (the same slot recomputed from the start below)
    redo = Step([req], release=np.array([0], np.int32))
    timed_steps(f"prefill {args.prefill}", [redo])
    prefill_ab: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.ab):  # the chunked forms with exp in place of flush_exp, and as are
        for flush in (False, True):
            gated_delta.flush_exp = mamba2.flush_exp = FLUSH_EXP if flush else plain_exp
            t0 = time.perf_counter()
            runner.step(redo)
            prefill_ab[flush].append(time.perf_counter() - t0)
    gated_delta.flush_exp = mamba2.flush_exp = FLUSH_EXP

    step_id = 1
    for b in batches:
        slots = list(range(1, b + 1))
        # Each slot: the prompt's pages and the snapshot, then its own pages.
        first = []
        for i, slot in enumerate(slots):
            own = prompt_pages + i * decode_pages + np.arange(decode_pages, dtype=np.int32)
            pages = np.concatenate((np.arange(prompt_pages, dtype=np.int32), own))
            first.append(StepReq(slot, prompt[-1:], args.prefill, pages, True, greedy,
                                 prompt_len=args.prefill + 1, state_restore=0))  # fmt: skip

        def decode(pos: int, slots: list[int] = slots) -> Step:
            nonlocal step_id
            step_id += 1
            reqs = [StepReq(s, np.array([7], np.int32), pos, np.zeros(0, np.int32), True)
                    for s in slots]  # fmt: skip
            return Step(reqs, step_id=step_id)

        runner.step(Step(first))
        pos = args.prefill + 1
        for _ in range(2):
            runner.step(decode(pos))
            pos += 1
        steps = [decode(pos + i) for i in range(args.steps)]
        timed_steps(f"decode B={b}", steps)
        if args.cprofile and b == 8:
            prof = cProfile.Profile()
            with prof:
                runner.step(decode(pos + args.steps))
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        pos += args.steps + 1
        times: dict[bool, list[float]] = {False: [], True: []}
        if args.ab:
            was = gated_delta.NATIVE, mamba2.NATIVE
            for _ in range(args.ab):
                for native in (False, True):
                    gated_delta.NATIVE = mamba2.NATIVE = native
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        runner.step(decode(pos))
                        pos += 1
                    times[native].append((time.perf_counter() - t0) / args.steps)
            gated_delta.NATIVE, mamba2.NATIVE = was
            ratios = [t / n for t, n in zip(times[False], times[True], strict=True)]
            med = statistics.median
            ab.append((b, med(times[False]), med(times[True]), med(ratios)))
        runner.step(Step([], release=np.array(slots, np.int32)))

    parts = sorted({k for _, _, p in table for k in p}, key=lambda k: -table[-1][2].get(k, 0.0))
    head = f"| {args.family} {args.dtype}, {args.layers} layers | " + " | ".join(
        f"{label}" for label, _, _ in table
    )
    print(head + " |")
    print("|---" * (len(table) + 1) + "|")
    print("| step (ms) | " + " | ".join(f"{t * 1e3:.1f}" for _, t, _ in table) + " |")
    for k in parts:
        cells = [f"{100 * p.get(k, 0.0) / t:.1f}%" for _, t, p in table]
        print(f"| {k} | " + " | ".join(cells) + " |")
    rest = [f"{100 * (1 - sum(p.values()) / t):.1f}%" for _, t, p in table]
    print("| rest (embedding, sampling, Python) | " + " | ".join(rest) + " |")
    if args.ab:
        t, f = prefill_ab[False], prefill_ab[True]
        ratio = statistics.median(a / b for a, b in zip(t, f, strict=True))
        print(
            f"\nprefill {args.prefill}: exp {statistics.median(t) * 1e3:.1f} ms, "
            f"flush_exp {statistics.median(f) * 1e3:.1f} ms, exp / flush_exp {ratio:.2f}"
        )
    if ab:
        print("\n| decode | torch (ms) | native (ms) | torch / native |")
        print("|---|---|---|---|")
        for b, t, n, r in ab:
            print(f"| B={b} | {t * 1e3:.1f} | {n * 1e3:.1f} | {r:.2f} |")
    with contextlib.suppress(Exception):
        tmp.cleanup()


if __name__ == "__main__":
    main()
