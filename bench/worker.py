"""Worker benchmark: radixserve's ModelRunner vs transformers, same weights and dtype, one run.

Measures prefill tokens/s for single prompts of the given lengths and decode step
time at the given batch sizes with the given context per request. For decode,
both sides start from a KV cache already holding ``--context`` tokens per
request (filled with random values: step time does not depend on them), then
take greedy steps; transformers uses its own DynamicCache. The two sides take
turns (``--rounds`` rounds of ``--steps`` steps each; prefill: ``--prefill-rounds``
rounds of one prompt each), so a drift in the machine's speed hits both; the
ratio is the median of the per-round ratios.

    python bench/worker.py                         # full run (SmolLM2, float32)
    python bench/worker.py --prefill 128 --batches 1,4 --context 64 --rounds 2   # quick
    python bench/worker.py --decode-kernel torch   # the gather + SDPA decode path
    python bench/worker.py --prefill "" --batches 1,16 --isa avx2,avx512   # CPU kernel levels
    python bench/worker.py --model-config mixtral  # a ~100M random model of a family

``--isa`` names the CPU kernels' instruction-set levels (layers/cpu_kernels.py)
radixserve runs; with several, each decode round runs every level in turn on
the same runner (the bench switches ``cpu_kernels.ISA`` between them), so the
levels are compared within one run, and the table adds each level's speedup
over the first one. Prefill runs at the first level.

``--tp 1,2`` compares tensor-parallel rank counts instead of transformers: one
runner per count (rank 0 in this process, the other ranks as processes: the
Engine's ``WorkerGroup``), the counts taking turns in every round, each run with
its ranks' share of the cores (``cores // tp`` threads; ``--threads N``: N threads
per rank at every count, to compare at equal threads per rank), with the share of rank
0's step time spent inside collectives (all-reduces and the logits gather,
waiting for the slower rank included).

``--model-config FAMILY`` (qwen3, mixtral, qwen3_moe, phi3) builds a random model of
about 100M parameters of that family with transformers' own config class, saves it
to a temporary folder and benchmarks it instead of ``--model``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
import torch

from radixserve.layers import cpu_kernels
from radixserve.models.loader import load_hf_config, parse_dtype
from radixserve.models.source import resolve_model
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0)
MAX_STEPS = 200  # KV room per decoding request beyond --context

#: ~100M-parameter shapes per family (tied embeddings, vocab 32000, hidden 768).
_BASE = dict(vocab_size=32000, hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
BENCH_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=12, intermediate_size=2048)),
    "phi3": ("Phi3Config", dict(num_hidden_layers=12, intermediate_size=2048,
                                original_max_position_embeddings=2048,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "short_factor": [1.0] * 32,
                                                 "long_factor": [2.0] * 32})),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=8, intermediate_size=512,
                                      num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=8, intermediate_size=2048,
                                         moe_intermediate_size=256, num_experts=16,
                                         num_experts_per_tok=4, norm_topk_prob=True)),
}  # fmt: skip


def random_model(family: str, folder: str) -> str:
    """Save a random ~100M-parameter float32 model of ``family`` into ``folder``."""
    import transformers

    cls, dims = BENCH_CONFIGS[family]
    config = getattr(transformers, cls)(**_BASE, **dims)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    print(f"random {family}: {n / 1e6:.1f}M parameters")
    model.save_pretrained(folder)
    return folder


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def timed(fn):
    """Yields the time of each call of ``fn``, forever."""
    while True:
        t = time.perf_counter()
        fn()
        yield time.perf_counter() - t


def ours_prefill(runner: ModelRunner, n: int):
    """Yields the time of each prefill of one fresh ``n``-token prompt."""
    ids = np.random.default_rng(0).integers(100, runner.vocab_size, n).astype(np.int32)
    pages = np.arange(-(-n // runner.page_size), dtype=np.int32)

    def run() -> None:
        runner.step(Step([StepReq(0, ids, 0, pages, True, GREEDY)]))
        runner.step(Step([], release=[0]))

    run()  # warm-up
    return timed(run)


def ours_decode(runner: ModelRunner, batch: int, context: int):
    """Yields the time of each decode step, forever (context grows by one per step)."""
    s = runner.page_size
    per_req = -(-(context + MAX_STEPS + 1) // s)
    tables = [np.arange(i * per_req, (i + 1) * per_req, dtype=np.int32) for i in range(batch)]
    for layer in runner.pool.layers:
        layer.normal_()
    held = [0] * batch
    pos = [context] * batch
    toks = np.full(batch, 100, dtype=np.int32)
    try:
        for step in range(MAX_STEPS):
            reqs = []
            for i in range(batch):
                need = -(-(pos[i] + 1) // s)
                reqs.append(StepReq(i, toks[i : i + 1], pos[i], tables[i][held[i] : need], True,
                                    GREEDY if step == 0 else None))  # fmt: skip
                held[i] = need
            t = time.perf_counter()
            toks = runner.step(Step(reqs)).tokens
            dt = time.perf_counter() - t
            pos = [p + 1 for p in pos]
            if step:  # the first step registers the slots
                yield dt
    finally:
        runner.step(Step([], release=list(range(batch))))


def hf_prefill(hf, n: int, vocab: int):
    """Yields the time of each transformers prefill of the same prompt."""
    ids = torch.from_numpy(np.random.default_rng(0).integers(100, vocab, n))[None]

    def run() -> None:
        with torch.no_grad():
            hf(ids, use_cache=True, logits_to_keep=1)

    run()
    return timed(run)


def hf_decode(hf, batch: int, context: int, dtype: torch.dtype):
    """Yields the time of each transformers decode step (its own DynamicCache)."""
    from transformers import DynamicCache

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    ids = torch.full((batch, 1), 100, dtype=torch.long)
    with torch.no_grad():
        for step in range(MAX_STEPS):
            t = time.perf_counter()
            out = hf(ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
            dt = time.perf_counter() - t
            cache = out.past_key_values
            if step:
                yield dt


def at_isa(isa: str, steps):
    """The same step stream, each step run with the CPU kernels at level ``isa``."""
    while True:
        cpu_kernels.ISA = isa
        yield next(steps)


def interleaved_isas(
    ours, isas: list[str], theirs, rounds: int, steps: int
) -> tuple[list[float], float, list[float], float]:
    """Like ``interleaved`` with one radixserve stream per level in ``isas`` (all
    drawing on ``ours``). Returns each level's median fastest step, transformers',
    each level's median per-round speedup over the first level, and the first
    level's median per-round speedup over transformers."""
    streams = [at_isa(i, ours) for i in isas]
    a: list[list[float]] = [[] for _ in isas]
    b: list[float] = []
    for _ in range(rounds):
        for times, stream in zip(a, streams):
            times.append(min(next(stream) for _ in range(steps)))
        b.append(min(next(theirs) for _ in range(steps)))
    ours.close()
    theirs.close()
    cpu_kernels.ISA = isas[0]
    over_first = [float(np.median([f / t for f, t in zip(a[0], times)])) for times in a]
    vs_hf = float(np.median([y / x for x, y in zip(a[0], b)]))
    return [float(np.median(t)) for t in a], float(np.median(b)), over_first, vs_hf


def interleaved(ours, theirs, rounds: int, steps: int) -> tuple[float, float, float]:
    """Alternate the two step streams, ``steps`` steps each per round, so that both
    see the same machine (shared machines drift). Returns the median over rounds
    of each side's fastest step, and the median of the per-round ratios."""
    a, b = [], []
    for _ in range(rounds):
        a.append(min(next(ours) for _ in range(steps)))
        b.append(min(next(theirs) for _ in range(steps)))
    ours.close()
    theirs.close()
    ratios = sorted(y / x for x, y in zip(a, b))
    return float(np.median(a)), float(np.median(b)), ratios[len(ratios) // 2]


def with_tp(stream, comm, threads: int):
    """The same step stream at ``threads`` torch threads, each step's time with the share
    of it spent in ``comm``'s collectives (0 without one)."""
    while True:
        torch.set_num_threads(threads)
        before = comm.stats.seconds if comm is not None else 0.0
        dt = next(stream)
        spent = comm.stats.seconds - before if comm is not None else 0.0
        yield dt, spent / dt


def tp_main(args, tps: list[int]) -> None:
    """Step times at each tensor-parallel rank count in ``tps``, side by side."""
    from radixserve.config import EngineConfig
    from radixserve.worker.tp import WorkerGroup, threads_per_rank

    max_b = max(args.batches, default=1)
    tokens = max(max(args.prefill, default=1), max_b * (args.context + MAX_STEPS + 2))
    pages = -(-tokens // args.page_size) + max_b
    config = EngineConfig(model=args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                          page_size=args.page_size, num_pages=pages,
                          max_running_requests=max(max_b, 1), decode_kernel=args.decode_kernel,
                          warmup=False, threads=args.threads or 0)  # fmt: skip
    runners, comms = [], []
    for tp in tps:
        if tp == 1:
            from radixserve.config import worker_config

            runners.append(build_runner(worker_config(config)))
            comms.append(None)
        else:
            group = WorkerGroup(replace(config, tp=tp), timed=True)
            runners.append(group)
            comms.append(group.runner.comm)
    print(f"model {runners[0].model_name}, dtype {args.dtype}, page_size {args.page_size}, "
          f"tp {', '.join(map(str, tps))}, threads per rank "
          f"{', '.join(str(args.threads or threads_per_rank(t)) for t in tps)}, weights per "
          "rank (MiB) "
          f"{', '.join(f'{r.weight_bytes / 2**20:.1f}' for r in runners)}")  # fmt: skip
    rows = []
    jobs = [(f"prefill {n} tok (ms)", lambda r, n=n: ours_prefill(r, n), args.prefill_rounds, 1)
            for n in args.prefill]  # fmt: skip
    jobs += [(f"decode b={b} ctx={args.context} (ms/step)",
              lambda r, b=b: ours_decode(r, b, args.context), args.rounds, args.steps)
             for b in args.batches]  # fmt: skip
    for name, make, rounds, steps in jobs:
        streams = [with_tp(make(r), c, args.threads or threads_per_rank(t))
                   for r, c, t in zip(runners, comms, tps)]  # fmt: skip
        times: list[list[float]] = [[] for _ in tps]
        shares: list[list[float]] = [[] for _ in tps]
        for _ in range(rounds):
            for i, stream in enumerate(streams):
                dt, share = min(next(stream) for _ in range(steps))
                times[i].append(dt)
                shares[i].append(share)
        for stream in streams:
            stream.close()
        speedups = [float(np.median([a / b for a, b in zip(times[0], t)])) for t in times]
        rows.append((name, [float(np.median(t)) for t in times], speedups,
                     [float(np.median(x)) for x in shares]))  # fmt: skip
    for r in runners:
        if hasattr(r, "close"):
            r.close()
    head = " | ".join(f"tp={t}" for t in tps)
    print(f"\n| metric | {head} | " + " | ".join(f"tp={t} collectives" for t in tps[1:]) + " |")
    print("|---" * (1 + 2 * len(tps) - 1) + "|")
    for name, med, speedups, shares in rows:
        cells = [f"{m * 1e3:.1f}" + (f" ({s:.2f}x)" if i else "")
                 for i, (m, s) in enumerate(zip(med, speedups))]  # fmt: skip
        share_cells = [f"{x:.0%}" for x in shares[1:]]
        print(f"| {name} | " + " | ".join(cells + share_cells) + " |")
    print(
        f"\n(speedup over tp={tps[0]}: median of per-round ratios; collectives: the median "
        "share of rank 0's step spent in all-reduces and the logits gather)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--model-config", choices=sorted(BENCH_CONFIGS), default=None,
                    help="benchmark a random ~100M model of this family instead of --model")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cache-dir", default=None, help="converted-model cache dir")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--prefill", type=ints, default=[512, 2048], help="prompt lengths, e.g. 512,2048"
    )
    ap.add_argument("--batches", type=ints, default=[1, 16, 64], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens in KV per decoding request")
    ap.add_argument("--steps", type=int, default=3, help="decode steps per side per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per batch size")
    ap.add_argument(
        "--prefill-rounds", type=int, default=8, help="interleaved rounds per prompt length"
    )
    ap.add_argument(
        "--decode-kernel", default="auto", choices=["auto", "native", "torch"],
        help="radixserve's decode attention (see docs/cpu-kernels.md)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--isa", default="auto", help="CPU kernel levels, e.g. avx2,avx512 "
                    "(default: the best this CPU runs)")  # fmt: skip
    ap.add_argument("--tp", type=ints, default=None,
                    help="compare tensor-parallel rank counts, e.g. 1,2 (no transformers)")  # fmt: skip
    args = ap.parse_args()
    if args.tp:
        if args.model_config:
            import tempfile

            args.model = random_model(args.model_config, tempfile.mkdtemp(prefix="rs-bench-"))
        return tp_main(args, args.tp)
    isas = [cpu_kernels.resolve_isa(i) for i in args.isa.split(",") if i] or [cpu_kernels.ISA]
    cpu_kernels.ISA = isas[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    if args.model_config:
        import tempfile

        args.model = random_model(args.model_config, tempfile.mkdtemp(prefix="rs-bench-"))
    dtype = parse_dtype(args.dtype)
    max_b = max(args.batches, default=1)
    tokens = max(max(args.prefill, default=1), max_b * (args.context + MAX_STEPS + 2))
    pages = -(-tokens // args.page_size) + max_b
    runner = build_runner(WorkerConfig(model=args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                                      page_size=args.page_size, num_pages=pages,
                                      max_running_requests=max(max_b, 1),
                                      decode_kernel=args.decode_kernel))  # fmt: skip
    source = resolve_model(args.model, args.cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        str(source.folder), config=load_hf_config(source), dtype=dtype,
        **({"gguf_file": source.gguf_file} if source.gguf_file else {}),
    ).eval()  # fmt: skip
    print(f"model {runner.model_name}, dtype {args.dtype}, page_size {args.page_size}, "
          f"torch threads {torch.get_num_threads()}, decode kernel "
          f"{getattr(runner.backend, 'decode_kernel', runner.backend_name)}, "
          f"CPU kernel levels {', '.join(isas)}")  # fmt: skip
    rows = []
    for n in args.prefill:
        ours, theirs, ratio = interleaved(
            ours_prefill(runner, n), hf_prefill(hf, n, runner.vocab_size),
            args.prefill_rounds, 1,
        )  # fmt: skip
        rows.append((f"prefill {n} tok (tok/s)", n / ours, n / theirs, ratio))
    if args.rounds * (args.steps + 1) >= MAX_STEPS:
        ap.error(f"rounds * (steps + 1) must stay below {MAX_STEPS}")
    level_rows = []
    for b in args.batches:
        if len(isas) == 1:
            ours, theirs, ratio = interleaved(
                ours_decode(runner, b, args.context), hf_decode(hf, b, args.context, dtype),
                args.rounds, args.steps,
            )  # fmt: skip
            rows.append((f"decode b={b} ctx={args.context} (ms/step)", ours * 1e3,
                         theirs * 1e3, ratio))  # fmt: skip
            continue
        per_isa, theirs, over_first, ratio = interleaved_isas(
            ours_decode(runner, b, args.context), isas, hf_decode(hf, b, args.context, dtype),
            args.rounds, args.steps,
        )  # fmt: skip
        rows.append((f"decode b={b} ctx={args.context} (ms/step)", per_isa[0] * 1e3,
                     theirs * 1e3, ratio))  # fmt: skip
        level_rows.append((b, per_isa, over_first))
    print(f"\n| {'metric':<30} | {'radixserve':>11} | {'transformers':>12} | {'speedup':>7} |")
    print(f"|{'-' * 32}|{'-' * 13}|{'-' * 14}|{'-' * 9}|")
    for name, ours, theirs, ratio in rows:
        print(f"| {name:<30} | {ours:>11.1f} | {theirs:>12.1f} | {ratio:>6.2f}x |")
    print(
        "\nspeedup = transformers time / radixserve time, the median over interleaved "
        "rounds of the per-round ratio (goal: prefill >= 1x, decode b>=16 >= 2x)"
    )
    if level_rows:
        print(f"\nradixserve decode ms/step per CPU kernel level (speedup over {isas[0]}, "
              "median of per-round ratios)\n")  # fmt: skip
        print("| batch | " + " | ".join(isas) + " |")
        print("|---" * (len(isas) + 1) + "|")
        for b, per_isa, over_first in level_rows:
            cells = [f"{t * 1e3:.1f} ({r:.2f}x)" for t, r in zip(per_isa, over_first)]
            print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
