"""Worker benchmark: radixserve's ModelRunner vs transformers, same weights and dtype, one run.

Measures prefill tokens/s for single prompts of the given lengths and decode step
time at the given batch sizes with the given context per request. For decode,
both sides start from a KV cache already holding ``--context`` tokens per
request (filled with random values: step time does not depend on them), then
take ``--decode-steps`` greedy steps; transformers uses its own DynamicCache.

    python bench/worker.py                         # full run (SmolLM2, float32)
    python bench/worker.py --prefill 128 --batches 1,4 --context 64 --steps 3   # quick
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from radixserve.models.loader import load_hf_config, parse_dtype, resolve_model
from radixserve.sampling_params import SamplingParams
from radixserve.worker.batch import ReqStep, StepBatch
from radixserve.worker.config import WorkerConfig
from radixserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def ours_prefill(runner: ModelRunner, n: int) -> float:
    ids = np.random.default_rng(0).integers(100, runner.vocab_size, n).astype(np.int32)
    pages = np.arange(-(-n // runner.page_size), dtype=np.int32)

    def run() -> None:
        runner.step(StepBatch([ReqStep(0, ids, 0, pages, True, GREEDY)]))
        runner.step(StepBatch([], release=[0]))

    return best_of(run, 2)


def ours_decode(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    s = runner.page_size
    per_req = -(-(context + steps + 1) // s)
    tables = [np.arange(i * per_req, (i + 1) * per_req, dtype=np.int32) for i in range(batch)]
    for layer in runner.pool.layers:
        layer.normal_()
    held = [0] * batch
    pos = [context] * batch
    toks = np.full(batch, 100, dtype=np.int32)
    times = []
    for step in range(steps + 1):
        reqs = []
        for i in range(batch):
            need = -(-(pos[i] + 1) // s)
            reqs.append(ReqStep(i, toks[i : i + 1], pos[i], tables[i][held[i] : need], True,
                                GREEDY if step == 0 else None))  # fmt: skip
            held[i] = need
        t = time.perf_counter()
        toks = runner.step(StepBatch(reqs))
        times.append(time.perf_counter() - t)
        pos = [p + 1 for p in pos]
    runner.step(StepBatch([], release=list(range(batch))))
    return min(times[1:])  # the first step registers the slots; min: least disturbed by load


def hf_prefill(hf, n: int, vocab: int) -> float:
    ids = torch.from_numpy(np.random.default_rng(0).integers(100, vocab, n))[None]

    def run() -> None:
        with torch.no_grad():
            hf(ids, use_cache=True, logits_to_keep=1)

    return best_of(run, 2)


def hf_decode(hf, batch: int, context: int, steps: int, dtype: torch.dtype) -> float:
    from transformers import DynamicCache

    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    ids = torch.full((batch, 1), 100, dtype=torch.long)
    times = []
    with torch.no_grad():
        for _ in range(steps + 1):
            t = time.perf_counter()
            out = hf(ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
            cache = out.past_key_values
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cache-dir", default=None, help="converted-model cache dir")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--prefill", type=ints, default=[512, 2048], help="prompt lengths, e.g. 512,2048"
    )
    ap.add_argument("--batches", type=ints, default=[1, 16, 64], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens in KV per decoding request")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    dtype = parse_dtype(args.dtype)
    max_b = max(args.batches, default=1)
    tokens = max(max(args.prefill, default=1), max_b * (args.context + args.steps + 2))
    pages = -(-tokens // args.page_size) + max_b
    runner = ModelRunner(WorkerConfig(model=args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                                      page_size=args.page_size, num_pages=pages,
                                      max_running_requests=max(max_b, 1)))  # fmt: skip
    source = resolve_model(args.model, args.cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        str(source.folder), config=load_hf_config(source), dtype=dtype,
        **({"gguf_file": source.gguf_file} if source.gguf_file else {}),
    ).eval()  # fmt: skip
    print(f"model {runner.model_name}, dtype {args.dtype}, page_size {args.page_size}, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    rows = []
    for n in args.prefill:
        ours, theirs = ours_prefill(runner, n), hf_prefill(hf, n, runner.vocab_size)
        rows.append((f"prefill {n} tok (tok/s)", n / ours, n / theirs, theirs / ours))
    for b in args.batches:
        ours = ours_decode(runner, b, args.context, args.steps)
        theirs = hf_decode(hf, b, args.context, args.steps, dtype)
        rows.append((f"decode b={b} ctx={args.context} (ms/step)", ours * 1e3, theirs * 1e3,
                     theirs / ours))  # fmt: skip
    print(f"\n| {'metric':<30} | {'radixserve':>11} | {'transformers':>12} | {'speedup':>7} |")
    print(f"|{'-' * 32}|{'-' * 13}|{'-' * 14}|{'-' * 9}|")
    for name, ours, theirs, ratio in rows:
        print(f"| {name:<30} | {ours:>11.1f} | {theirs:>12.1f} | {ratio:>6.2f}x |")
    print(
        "\nspeedup = transformers time / radixserve time (goal: prefill >= 1x, decode b>=16 >= 2x)"
    )


if __name__ == "__main__":
    main()
