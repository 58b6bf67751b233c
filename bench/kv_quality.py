"""Quantized KV quality, teacher-forced, against a float32 pool (llama.cpp's measure).

One fixed text (Python's own documentation, ``pydoc_data.topics``, the first
``--tokens`` tokens) is prefilled on the embedded SmolLM2 in chunks of ``--chunk``
tokens, one in-process Engine per KV dtype, so every chunk reads the earlier chunks'
K/V back from the pool in its format. Each position's full-vocabulary next-token
distribution (the worker's logits, not top-k logprobs) is compared with the float32
pool's: mean KL divergence KL(P_float32 || P_dtype), its ratio to the bfloat16 pool's,
top-1 agreement, and the pool's tokens per GiB (``radixserve.benchmark.kv_quality``).

``--dtype`` is the model's (weights and activations): ``bfloat16`` as served, where K/V
are computed in bfloat16 and a float32 pool stores them exactly (the bfloat16 row is
then the attention kernels' own difference, the floor any format adds to), or
``float32``, where the bfloat16 pool rounds K/V too (KV rounding alone).

The quantized pools are measured as built: keys stored rotated by the Hadamard matrix
(queries rotated alike), fp8 keys less a calibrated constant per layer and kv head and
with the searched scale and GPTQ-rounded, and each sequence's position 0 as int8 sink
rows in the fp8 formats (docs/kv-cache.md, "Quantized KV cache"). Measured (defaults,
2-core AMD EPYC, 2026-12-07; bench/results/kv_quality.md): KL 1.23x bfloat16's for int8
(top-1 97.90%), 1.71x for fp8_e4m3 (97.07%), 3.93x for fp8_e5m2 (95.95%); bfloat16
0.001733 (97.95%). ``--tokens 8000 --kv-memory 536870912``: int8 1.20x, fp8_e4m3 2.40x
(96.92%), bfloat16 97.95%.

A name ``fp8_e4m3@tensor`` or ``fp8_e4m3@token_head`` stores that format in another
pool layout than the CPU's own (``kv_quant.KV_LAYOUTS``: the ones CUDA's flashinfer
backend reads), here through the torch backend: what the stored values cost on a GPU.

    python bench/kv_quality.py
    python bench/kv_quality.py --dtype float32
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from radixserve.benchmark.kv_quality import compare, teacher_forced_logits  # noqa: E402


def fixed_text() -> str:
    """Python's topic help pages, in key order: real prose and code, a fixed text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the fixed text")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk (tokens)")
    ap.add_argument("--kv-dtypes", default="bfloat16,int8,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--kv-memory", type=int, default=1 << 28)
    args = ap.parse_args()

    from radixserve import Engine
    from radixserve.models.tokenizer import load_tokenizer

    ids = load_tokenizer(args.model).encode(fixed_text())[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the fixed text has only {len(ids)} tokens")
    names = ["float32"] + [n for n in args.kv_dtypes.split(",") if n != "float32"]
    ref = None
    rows = []
    from radixserve.worker import build

    layout_for = build.kv_layout_for
    for name in names:
        t = time.perf_counter()
        kv, _, layout = name.partition("@")
        if layout:  # the layout CUDA would pick, forced here (the CPU keeps ``row``)
            build.kv_layout_for = lambda *a, layout=layout: layout
        try:
            eng = Engine(model=args.model, dtype=args.dtype, kv_cache_dtype=kv,
                         chunked_prefill_size=args.chunk, kv_memory=args.kv_memory)  # fmt: skip
        finally:
            build.kv_layout_for = layout_for
        logits = teacher_forced_logits(eng, ids)
        per_gib = eng.runner.info().tokens_per_gib
        eng.close()
        if ref is None:
            ref = logits
        kl, top1, worst = compare(ref, logits)
        rows.append((name, kl, top1, worst, per_gib))
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        del logits
    base = next((r[1] for r in rows if r[0] == "bfloat16"), None)
    print(f"SmolLM2 ({args.model}), {args.dtype} weights, {len(ids)} tokens of "
          f"pydoc_data.topics, {args.chunk}-token prefill chunks, full-vocabulary "
          f"distributions against the float32 pool; {cpu_name()}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print("| kv dtype | KL mean | KL / bfloat16's | KL max | top-1 agreement | tokens per GiB |")
    print("|---|---|---|---|---|---|")
    for name, kl, top1, worst, per_gib in rows:
        ratio = f"{kl / base:.2f}x" if base and name != "float32" else "-"
        label = f"{name} (reference)" if name == "float32" else name
        print(f"| {label} | {kl:.6f} | {ratio} | {worst:.4f} | {top1:.2%} | {per_gib} |")


if __name__ == "__main__":
    main()
