"""Decode steps against this machine's roofline: measured / the least the step could take.

Measures two figures of this machine at the thread count the worker uses
(``torch.get_num_threads()``, or ``--threads``), before and after the steps,
keeping the better of the two (other jobs on a shared machine lower them;
``--bandwidth`` and ``--peak`` give a quiet run's figures instead):

- **bandwidth**: the faster of a large float32 copy (bytes read + bytes written per
  second) and a large float32 sum (bytes read per second), 256 MiB each, far
  beyond the caches: what streaming weights and KV from memory can reach;
- **bf16 peak**: a large bfloat16 matrix product through torch (oneDNN; on AMX
  tiles where the CPU has them), 2 x n^3 FLOPs per second, the best of a few sizes.

Then, for each batch size B, the all-cached repeat of ``bench/cached_decode.py``
with one group: B prompts sharing one ``--system-len``-token prefix plus their
own ``--question-len``-token questions, ``--output-len`` tokens each, greedy.
A first run fills the cache; each round runs the same prompts again, and every
step whose requests all decode one token is timed (``ModelRunner.step``). Each
timed step's bound is the larger of

- bytes / bandwidth: the model's weights in the serving dtype once (a tied LM head
  counted once: the embedding lookup reads only B rows) plus the K/V the step
  reads, the shared prefix once (cascade attention reads it once for the group)
  and each request's own keys after it;
- FLOPs / peak: 2 x B x (the layers' matrix parameters + the LM head's) plus the
  attention's 4 x heads x head_dim x context per request and layer.

The table gives the median measured step, the median bound and the median of
per-step ratios. ``--idle S`` also sleeps S seconds after the rounds and runs the
prompts once more: its first decode step against the steady median (a lone
request after an idle server). ``--layers 0,1`` runs each round once per value
of ``models.decode_step.ENABLED`` (the layers one by one in Python, or in one
native call where it can), taking turns, and gives a row per value.

``--prefills 1x2048,32x160`` first times prefills: PROMPTS fresh random prompts of
TOKENS tokens each, submitted at once (the cache flushed, one output token), every step
that computes prompt tokens only, the best of ``--rounds`` (after one to warm up), and
prints a table of their FLOPs (each computed token through the layers' products, the LM
head once a chunk, causal attention) per second against the bf16 peak.

    python bench/roofline.py --batches 1,8,32 --system-len 400 --rounds 3 --layers 0,1
    python bench/roofline.py --batches 8 --prefills 1x2048,4x832,32x160
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) bytes per second: a ``mib``-MiB float32 copy counted as bytes read +
    written, and a sum over it counted as bytes read."""
    a = torch.randn(mib * 2**20 // 4)
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    copy = 2 * nbytes / _best(lambda: b.copy_(a), repeats)
    read = nbytes / _best(lambda: a.sum(), repeats)
    return copy, read


def measure_bf16_peak(sizes=(1024, 2048, 4096), repeats: int = 3) -> float:
    """FLOPs per second of the best square bfloat16 matrix product among ``sizes``."""
    best = 0.0
    for n in sizes:
        x = torch.randn(n, n, dtype=torch.bfloat16)
        y = torch.randn(n, n, dtype=torch.bfloat16)
        best = max(best, 2 * n**3 / _best(lambda x=x, y=y: torch.mm(x, y), repeats))
    return best


class StepCost:
    """Bytes and FLOPs of one decode step of a loaded ``CausalLM``."""

    def __init__(self, model: torch.nn.Module, kv_dtype: torch.dtype) -> None:
        cfg = model.cfg
        self.weight_bytes = model.weight_bytes()
        matrices = sum(p.numel() for p in model.layers.parameters() if p.dim() >= 2)
        self.lm_head_params = model.lm_head.weight.numel()
        self.matmul_params = matrices + self.lm_head_params
        self.heads, self.head_dim, self.layers = cfg.num_heads, cfg.head_dim, cfg.num_layers
        elem = torch.empty(0, dtype=kv_dtype).element_size()
        self.kv_token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem

    def bytes(self, contexts: list[int], shared: int) -> int:
        """Weights once plus the K/V read: ``shared`` prefix tokens once, the rest per request."""
        own = sum(max(c - shared, 0) for c in contexts)
        return self.weight_bytes + (min(shared, min(contexts)) + own) * self.kv_token_bytes

    def flops(self, contexts: list[int]) -> int:
        attention = 4 * self.heads * self.head_dim * self.layers * sum(contexts)
        return 2 * len(contexts) * self.matmul_params + attention

    def prefill_flops(self, chunks: list[tuple[int, int]]) -> int:
        """FLOPs of a prefill step of ``(start, new tokens)`` chunks: every new token
        through every layer's matrices, the LM head once per chunk (the last token's
        logits), and causal attention (token at position p reads p + 1 keys)."""
        tokens = sum(n for _, n in chunks)
        keys = sum(n * start + n * (n + 1) // 2 for start, n in chunks)
        head = self.lm_head_params * len(chunks)
        attention = 4 * self.heads * self.head_dim * self.layers * keys
        return 2 * tokens * (self.matmul_params - self.lm_head_params) + 2 * head + attention


def measure_prefill(
    engine, runner, cost: StepCost, src, n_prompts: int, n_tokens: int, rounds: int
) -> tuple[int, float, int]:
    """(steps, seconds, FLOPs) of ``rounds`` prefills of ``n_prompts`` fresh random prompts
    of ``n_tokens`` tokens each, all submitted at once (one output token each, the
    cache flushed first): every step that computes prompt tokens only, at the best
    round (the least total time)."""
    from radixserve import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    run_step = runner.step
    best = None
    for _ in range(rounds + 1):  # the first round warms up
        done: list[tuple[float, int]] = []

        def timed(batch, done=done):
            t = time.perf_counter()
            out = run_step(batch)
            chunks = [(r.start_pos, len(r.input_ids)) for r in batch.reqs]
            if chunks and all(n > 1 for _, n in chunks):
                done.append((time.perf_counter() - t, cost.prefill_flops(chunks)))
            return out

        runner.step = timed
        engine.flush_cache()
        engine.generate([src.take(n_tokens) for _ in range(n_prompts)], sp)
        runner.step = run_step
        seconds, flops = sum(t for t, _ in done), sum(f for _, f in done)
        if best is None or seconds < best[1]:
            best = (len(done), seconds, flops)
    return best  # type: ignore[return-value]


def parse_prefill(ap: argparse.ArgumentParser, shape: str) -> tuple[int, int]:
    """``PROMPTSxTOKENS`` as (prompts, tokens): at least one prompt of at least two tokens
    (a one-token prompt has no prefill step to time); anything else is the parser's
    error."""
    parts = shape.split("x")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        n, t = int(parts[0]), int(parts[1])
        if n >= 1 and t >= 2:
            return n, t
    ap.error(f"--prefills: {shape!r} is not PROMPTSxTOKENS with PROMPTS >= 1 and TOKENS >= 2")
    raise AssertionError  # ap.error exits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--system-len", type=int, default=400)
    ap.add_argument("--question-len", type=int, default=30)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--idle", type=float, default=0.0, help="seconds idle before a last run")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", default="1", help="decode_step.ENABLED values, e.g. 0,1")
    ap.add_argument("--bandwidth", type=float, help="GB/s: skip measuring (a quiet run's)")
    ap.add_argument("--peak", type=float, help="bf16 GFLOP/s: skip measuring")
    ap.add_argument("--prefills", default="",
                    help="prefill shapes PROMPTSxTOKENS, e.g. 1x2048,8x832: fresh prompts "
                         "prefilled at once, every prefill step against the bf16 peak")  # fmt: skip
    args = ap.parse_args()
    prefills = [parse_prefill(ap, shape) for shape in filter(None, args.prefills.split(","))]
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    # Other jobs on the machine lower what is measured: both figures are measured
    # before and after the steps and the better kept (or given).
    copy_bw, read_bw = measure_bandwidth() if args.bandwidth is None else (0.0, 0.0)
    peak = measure_bf16_peak() if args.peak is None else args.peak * 1e9

    from radixserve import Engine, SamplingParams
    from radixserve.benchmark.workloads import TokenSource, shared_prefix
    from radixserve.layers import cpu_kernels
    from radixserve.models import decode_step
    from radixserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    src = TokenSource.random(len(tok), args.seed, exclude=tok.all_special_ids)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine = Engine(model=args.model)
    runner = engine.runner
    cost = StepCost(runner.model, runner.pool.dtype)
    steps: list[tuple[float, list[int]]] = []
    run_step = runner.step

    def timed_step(batch):
        t = time.perf_counter()
        out = run_step(batch)
        if batch.reqs and all(len(r.input_ids) == 1 for r in batch.reqs):
            contexts = [r.start_pos + 1 for r in batch.reqs]
            steps.append((time.perf_counter() - t, contexts))
        return out

    prefill_rows = [
        (f"{n}x{t}", measure_prefill(engine, runner, cost, src, n, t, args.rounds))
        for n, t in prefills
    ]
    runner.step = timed_step  # type: ignore[method-assign]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        work = shared_prefix(src, 1, b, args.system_len, args.question_len, args.output_len)
        prompts = [node.tokens for node in work.roots]
        engine.generate(prompts, sp)  # fills the cache
        modes = [m.strip() == "1" for m in args.layers.split(",")]
        timed: dict[bool, list] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                decode_step.ENABLED = mode
                steps.clear()
                engine.generate(prompts, sp)
                timed[mode] += steps
        for mode in modes:
            done = timed[mode]
            measured = [t for t, _ in done]
            nbytes = [cost.bytes(c, args.system_len) for _, c in done]
            flops = [cost.flops(c) for _, c in done]

            def ratio(bw, pk, measured=measured, nbytes=nbytes, flops=flops):
                bounds = [max(n / bw, f / pk) for n, f in zip(nbytes, flops)]
                return statistics.median(m / x for m, x in zip(measured, bounds))

            idle = ""
            if args.idle > 0:
                decode_step.ENABLED = mode
                steps.clear()
                time.sleep(args.idle)
                engine.generate(prompts, sp)
                idle = f"{steps[0][0] * 1e3:.1f}"
            rows.append(
                (
                    b,
                    "" if len(modes) == 1 else ("one call" if mode else "per op"),
                    statistics.median(measured) * 1e3,
                    statistics.median(nbytes) / 1e9 * 1e3,  # ms at 1 GB/s
                    statistics.median(flops),
                    ratio,
                    idle,
                )
            )
        decode_step.ENABLED = True
    info = runner.info()
    engine.close()
    if args.bandwidth is None:
        copy2, read2 = measure_bandwidth()
        copy_bw, read_bw = max(copy_bw, copy2), max(read_bw, read2)
    if args.peak is None:
        peak = max(peak, measure_bf16_peak())
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else max(copy_bw, read_bw)
    rows = [
        (b, mode, m, mem_s * 1e9 / bandwidth, comp_f / peak * 1e3,
         max(mem_s * 1e9 / bandwidth, comp_f / peak * 1e3), ratio_fn(bandwidth, peak), idle)
        for b, mode, m, mem_s, comp_f, ratio_fn, idle in rows
    ]  # fmt: skip
    print(
        f"{info.model_name}, {info.dtype}, {threads} threads, isa {cpu_kernels.ISA}, AMX "
        f"{cpu_kernels.AMX}; weights {cost.weight_bytes / 1e6:.1f} MB, K/V "
        f"{cost.kv_token_bytes / 1e3:.1f} kB per token; {args.system_len}-token shared prefix, "
        f"{args.question_len}-token questions, {args.output_len} output tokens"
    )
    print(
        f"bandwidth {bandwidth / 1e9:.1f} GB/s (copy {copy_bw / 1e9:.1f}, read "
        f"{read_bw / 1e9:.1f}); bf16 peak {peak / 1e9:.0f} GFLOP/s"
    )
    if prefill_rows:
        print("| prefill | steps | measured ms | compute bound ms | GFLOP/s | of bf16 peak |")
        print("|---|---|---|---|---|---|")
        for shape, (n, t, f) in prefill_rows:
            print(f"| {shape} | {n} | {t * 1e3:.1f} | {f / peak * 1e3:.1f} | {f / t / 1e9:.0f} "
                  f"| {f / peak / t:.0%} |")  # fmt: skip
    print("| batch | layers | measured ms | memory bound ms | compute bound ms | bound ms "
          "| measured / bound | first step after idle ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for b, mode, m, mem, comp, bound, ratio, idle in rows:
        print(f"| {b} | {mode} | {m:.1f} | {mem:.1f} | {comp:.1f} | {bound:.1f} | {ratio:.2f}x "
              f"| {idle} |")  # fmt: skip


if __name__ == "__main__":
    main()
