"""Prefill attention benchmark: one layer's attention for a step of prefill chunks,
through each path the torch backend can give them, in GFLOP per CPU-second.

SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64, bfloat16, pages of 16):
``--chunks`` requests, each ``--new`` new tokens after ``--cached`` cached ones (its own
pages, scattered over the pool). Every path plans the step once (``begin_batch``, once
per step for all layers in a served step) and times the backend's ``forward`` for layer
0 (the K/V rows written, then attention); the paths take turns in every round, each
keeping its fastest call of the round by process CPU time (robust on a loaded machine),
and the table shows the median over rounds (``--wall``: wall time instead, for more
than one thread):

- ``prefix``: ``cpu_kernels.prefix_attention_chunks`` with a causal limit per query
  vector, one call for every chunk (``TorchAttention.prefill_amx``; AMX tiles, or
  ``vdpbf16ps`` at avx512bf16);
- ``native``: the native paged kernel, each chunk a causal segment
  (``native_prefill_max_tokens``);
- ``sdpa``: gather + ``scaled_dot_product_attention``.

GFLOP counts only the keys each query vector sees (4 x head_dim per query head and key:
the scores and the value sums), not the blocks a kernel computes past the diagonal.

``--engine`` times a whole prefill instead (the ``prefix_repetition`` shape):
``--prompts`` prompts at once, each one of ``--prefixes`` random prefixes of
``--prefix-len`` tokens plus ``--own`` tokens of its own, through an in-process Engine
of ``--model`` (``max_tokens`` 1, cache flushed before each trial), in process CPU
seconds and GFLOP per CPU-second: the layers' products (2 x their weights per computed
token) and attention (each prefix computed once, causal; each prompt's own tokens over
its prefix).

    python bench/prefill_attention.py --threads 1                          # 768 fresh
    python bench/prefill_attention.py --threads 1 --new 64 --cached 768 --chunks 28
    python bench/prefill_attention.py --threads 1 --new 8,16,32,64,128 --cached 832
    python bench/prefill_attention.py --threads 2 --wall --new 64 --cached 768 --chunks 28
    python bench/prefill_attention.py --threads 1 --engine
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import AttentionBatch, create_backend
from radixserve.worker.kv_pool import KVPool

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
PATHS = ("prefix", "native", "sdpa")


def step(new: int, cached: int, chunks: int, rng: np.random.Generator):
    """A batch of ``chunks`` requests of ``new`` tokens after ``cached`` ones, with a pool
    that holds them, and its q/k/v."""
    per_req = -(-(cached + new) // PAGE)
    pool = KVPool(1, chunks * per_req + 4, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16)
    pool.layers[0].normal_()
    pages = rng.permutation(chunks * per_req).astype(np.int32)
    batch = AttentionBatch(
        qo_indptr=np.arange(chunks + 1, dtype=np.int32) * new,
        kv_lens=np.full(chunks, cached + new, np.int32),
        page_indptr=np.arange(chunks + 1, dtype=np.int32) * per_req,
        page_indices=pages,
    )
    t = chunks * new
    q = torch.randn(t, HEADS, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(t, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    v = torch.randn(t, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    return pool, batch, (q, k, v)


def backend_for(path: str, pool: KVPool):
    backend = create_backend("torch", pool, HEAD_DIM**-0.5, (-1,), HEADS, decode_kernel="native")
    backend.shared_prefix_flash = False  # chunks alone: no cascade groups
    backend.prefill_amx = path == "prefix"
    backend.native_prefill_max_tokens = 1 << 30 if path == "native" else 0
    return backend


def engine_prefill(args: argparse.Namespace) -> None:
    """The whole prefill of the prefix_repetition shape through an Engine (``--engine``)."""
    from radixserve import Engine, SamplingParams

    eng = Engine(args.model, threads=args.threads)
    model = eng.runner.model
    layer_params = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")
    )
    cfg = eng.runner.model_config
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0)
    eng.generate([rng.integers(100, 40000, 300).tolist()], sp)  # warm
    n_pre, own = args.prefix_len, args.own
    tokens = args.prefixes * n_pre + args.prompts * own
    seen = args.prefixes * n_pre * (n_pre + 1) // 2 + args.prompts * sum(
        n_pre + t + 1 for t in range(own)
    )
    products = 2 * tokens * layer_params
    attention = 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers * seen
    print(f"{args.model}, {args.threads} thread(s): {args.prompts} prompts = {args.prefixes} "
          f"prefixes x {n_pre} + {own} own tokens; products {products / 1e12:.3f} TFLOP, "
          f"attention {attention / 1e12:.3f}")  # fmt: skip
    for trial in range(args.trials):
        pre = [rng.integers(100, 40000, n_pre).tolist() for _ in range(args.prefixes)]
        prompts = [
            pre[i % args.prefixes] + rng.integers(100, 40000, own).tolist()
            for i in range(args.prompts)
        ]
        eng.flush_cache()
        t, w = time.process_time(), time.perf_counter()
        eng.generate(prompts, sp)
        cpu, wall = time.process_time() - t, time.perf_counter() - w
        print(f"trial {trial}: cpu {cpu:.2f} s, wall {wall:.2f} s, "
              f"{(products + attention) / cpu / 1e9:.1f} GFLOP per CPU-second")  # fmt: skip
    eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", default="768", help="new tokens per chunk (a list: one row each)")
    ap.add_argument("--cached", type=int, default=0, help="cached tokens before each chunk")
    ap.add_argument("--chunks", type=int, default=1, help="requests in the step")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="calls per path per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="time wall, not process CPU, time")
    ap.add_argument("--engine", action="store_true", help="a whole prefill (see above)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--trials", type=int, default=2)
    args = ap.parse_args()
    if args.engine:
        return engine_prefill(args)
    if not cpu_kernels.AVAILABLE:
        raise SystemExit(f"native kernels not built ({cpu_kernels.UNAVAILABLE_REASON})")
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    clock_name = "wall time" if args.wall else "CPU time"
    paths = [p for p in args.paths.split(",") if p]
    if "prefix" in paths and not cpu_kernels.prefix_attention_ok():
        raise SystemExit("prefix_attention does not run here (no AMX, below avx512bf16)")
    print(f"isa {cpu_kernels.ISA}, amx {cpu_kernels.AMX}, {args.threads} thread(s); "
          f"{HEADS} heads / {KV_HEADS} kv heads / head_dim {HEAD_DIM}; ms per call "
          f"({clock_name}) and GFLOP per {clock_name[:-5]}-second")  # fmt: skip
    print(f"| chunks x new | cached | {' | '.join(paths)} |")
    print(f"|---|---|{'---|' * len(paths)}")
    rng = np.random.default_rng(0)
    for new in (int(x) for x in args.new.split(",")):
        pool, batch, (q, k, v) = step(new, args.cached, args.chunks, rng)
        seen = args.chunks * sum(args.cached + t + 1 for t in range(new))
        flop = 4 * HEAD_DIM * HEADS * seen
        backends = {p: backend_for(p, pool) for p in paths}
        for backend in backends.values():
            backend.begin_batch(batch)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for p, backend in backends.items():
                best = float("inf")
                for _ in range(args.calls):
                    t0 = clock()
                    backend.forward(0, q, k, v)
                    best = min(best, clock() - t0)
                times[p].append(best)
        cells = []
        for p in paths:
            t = statistics.median(times[p])
            cells.append(f"{t * 1e3:.2f} ms, {flop / t / 1e9:.0f}")
        print(f"| {args.chunks} x {new} | {args.cached} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
