"""Decode-kernel benchmark: the native paged decode attention alone, one layer, per
instruction-set level.

SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64): ``--batch`` decode
requests with ``--context`` keys each, their pages scattered over the pool. The
levels take turns in every round (each keeps its fastest of ``--calls`` calls),
and the table shows the median time and the median per-round speedup over the
first level.

    python bench/decode_kernel.py                                  # float32 and bfloat16
    python bench/decode_kernel.py --isa avx2,avx512 --batch 64 --context 1024
    python bench/decode_kernel.py --shared --batch 32 --context 1000 --dtypes bfloat16

``--shared``: the cascade call instead, all ``--batch`` requests reading one prefix of
``--context`` keys (one segment of ``--batch`` rows, as a shared system prompt is read).
``--kv int8,fp8_e4m3``: quantized pools (``--kv-cache-dtype``) beside the plain one
(``auto``: the query dtype), each read with every query dtype of ``--dtypes``.

    python bench/decode_kernel.py --shared --batch 32 --context 500 --dtypes bfloat16 \
        --kv auto,int8,fp8_e4m3,fp8_e5m2 --isa avx512bf16 --threads 1
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from radixserve.layers import cpu_kernels
from radixserve.worker import kv_quant
from radixserve.worker.attention import native_decode

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--isa", default="", help="levels (default: every level this CPU runs)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per level per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shared", action="store_true", help="one shared prefix, read by every row")
    ap.add_argument("--kv", default="auto", help="pool formats: auto (the query dtype), "
                    "int8, fp8_e4m3, fp8_e5m2")  # fmt: skip
    args = ap.parse_args()
    if not cpu_kernels.AVAILABLE:
        raise SystemExit(f"native kernels not built ({cpu_kernels.UNAVAILABLE_REASON})")
    torch.set_num_threads(args.threads)
    isas = [cpu_kernels.resolve_isa(i) for i in args.isa.split(",") if i]
    isas = isas or list(cpu_kernels.supported_isas())
    b, ctx, ps = args.batch, args.context, args.page_size
    per_req = -(-ctx // ps)
    rng = np.random.default_rng(0)
    num_pages = per_req if args.shared else b * per_req
    pages = rng.permutation(num_pages).astype(np.int32)
    if args.shared:
        rows, tables, lens = [np.arange(b, dtype=np.int32)], [pages], np.full(1, ctx)
    else:
        tables = [pages[i * per_req : (i + 1) * per_req] for i in range(b)]
        rows, lens = [np.array([i], np.int32) for i in range(b)], np.full(b, ctx)
    seg = native_decode.Segments.build(rows, tables, lens, [-1], KV_HEADS)
    shape = "one shared prefix" if args.shared else "one context per request"
    print(f"batch {b}, context {ctx} ({shape}), page size {ps}, {args.threads} threads; "
          f"us per call (speedup over {isas[0]})\n")  # fmt: skip
    print("| dtype | kv | " + " | ".join(isas) + " |")
    print("|---" * (len(isas) + 2) + "|")
    combos = [(d, k) for d in args.dtypes.split(",") if d for k in args.kv.split(",") if k]
    for name, kv_name in combos:
        dtype = getattr(torch, name)
        values = torch.randn(num_pages, 2, ps, KV_HEADS, HEAD_DIM)
        quant = kv_quant.QUANTS.get(kv_name)
        kv = kv_quant.quantize(values, quant) if quant else values.to(dtype)
        q = torch.randn(b, HEADS, HEAD_DIM).to(dtype)
        out = torch.empty_like(q)
        times: dict[str, list[float]] = {i: [] for i in isas}
        for _ in range(args.rounds):
            for isa in isas:
                best = float("inf")
                for _ in range(args.calls):
                    t = time.perf_counter()
                    native_decode.paged_decode(q, kv, out, None, seg, -1, HEAD_DIM**-0.5, isa,
                                               quant=quant)  # fmt: skip
                    best = min(best, time.perf_counter() - t)
                times[isa].append(best)
        first = times[isas[0]]
        cells = [
            f"{np.median(t) * 1e6:.0f} ({np.median([f / x for f, x in zip(first, t)]):.2f}x)"
            for t in times.values()
        ]
        print(f"| {name} | {kv_name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
