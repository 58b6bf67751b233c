"""Decode bandwidth: bytes a decode step must move, over its time, against a copy.

    python bench/gpu_decode_bw.py [--batches 1,8,32,128 --contexts 512,4096]
    python bench/gpu_decode_bw.py --device cpu --tiny        # a seconds-long run on a CPU

A random Llama-shaped model (~1.1B parameters in bf16: hidden 2048, 16 layers, 16 heads
of 128, 8 KV heads, MLP 8192, vocab 32000, untied head) runs decode steps through the
ModelRunner as the server does (flashinfer and CUDA graphs where they run) over a KV
pool filled with random values; every request sits at ``context`` tokens.

A decode step must at least read every weight once (the embedding table only in its
batch rows: the untied LM head reads its own matrix), read each request's K and V of
every layer, and write the new token's K and V; activations are left out (at batch
128 they are under 1% of it). That sum over the median step time is the step's
bandwidth, printed against a device-to-device copy measured in the same run (a copy
reads and writes each byte: 2 x size / time). Goal on a GPU: >= 70% of the copy at
batch 128 x context 4096 (``--check`` makes that the exit status).

``--sync-debug``: also runs steady-state decode steps' forwards under
``torch.cuda.set_sync_debug_mode("error")``, so a hidden host sync in the decode step
(anything before reading the sampled tokens) fails the run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig

GREEDY = SamplingParams(temperature=0)
GOAL = 0.70  # of the copy bandwidth, at the largest batch x context


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    def config(self):
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            tie_word_embeddings=self.tied, max_position_embeddings=8192,
        )  # fmt: skip

    def parameters(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab * h
        return self.layers * per_layer + h + embed * (1 if self.tied else 2)

    def kv_bytes_per_token(self, kv_elem: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * kv_elem


GPU_1B = LlamaShape(hidden=2048, intermediate=8192, layers=16, heads=16, kv_heads=8,
                    head_dim=128, vocab=32000)  # fmt: skip
TINY = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                  vocab=256)  # fmt: skip


def step_bytes(shape: LlamaShape, contexts: list[int], elem: int, kv_elem: int) -> dict[str, int]:
    """Bytes one decode step moves at least, requests at ``contexts`` tokens before it:
    the weights (all but the embedding table, of which the batch's rows; a tied table is
    read whole as the LM head), K/V read (each request's context and its new token) and
    the new tokens' K/V written."""
    batch = len(contexts)
    embed = shape.vocab * shape.hidden * elem
    weights = shape.parameters() * elem - (0 if shape.tied else embed) + batch * shape.hidden * elem
    per_token = shape.kv_bytes_per_token(kv_elem)
    return {
        "weights": weights,
        "kv_read": per_token * sum(c + 1 for c in contexts),
        "kv_write": per_token * batch,
    }


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes per second of ``dst.copy_(src)`` counted as read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


class Decoder:
    """Decode steps of ``batch`` requests from ``context`` tokens, on pages of their own."""

    def __init__(self, runner, batch: int, context: int, room: int) -> None:
        self.runner, self.batch = runner, batch
        s = runner.page_size
        per_req = -(-(context + room + 1) // s)
        self.tables = [np.arange(i * per_req, (i + 1) * per_req, dtype=np.int32)
                       for i in range(batch)]  # fmt: skip
        self.held = [0] * batch
        self.pos = [context] * batch
        self.tokens = np.full(batch, 100, dtype=np.int32)
        self.started = False

    def step_of(self) -> Step:
        s = self.runner.page_size
        reqs = []
        for i in range(self.batch):
            need = -(-(self.pos[i] + 1) // s)
            reqs.append(StepReq(i, self.tokens[i : i + 1], self.pos[i],
                                self.tables[i][self.held[i] : need], True,
                                None if self.started else GREEDY))  # fmt: skip
            self.held[i] = need
        self.started = True
        return Step(reqs)

    def step(self) -> float:
        """One step through ``runner.step`` (sampling and reading the tokens); its time."""
        batch = self.step_of()
        t = time.perf_counter()
        self.tokens = self.runner.step(batch).tokens
        dt = time.perf_counter() - t
        self.pos = [p + 1 for p in self.pos]
        return dt

    def forward_without_sync(self) -> None:
        """One step's forward under sync-debug "error" (on CUDA), then its greedy tokens read."""
        batch = self.step_of()
        cuda = self.runner.pool.layers[0].is_cuda
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            logits = self.runner.forward_logits(batch)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
        self.tokens = logits.argmax(-1).to(torch.int32).cpu().numpy()
        self.pos = [p + 1 for p in self.pos]

    def close(self) -> None:
        self.runner.step(Step([], release=list(range(self.batch))))


def make_model(shape: LlamaShape, dtype: torch.dtype, folder: str | None) -> str:
    """Save a random model of ``shape`` into ``folder`` (a new temporary one if None); a
    folder that holds one of this shape already is reused (a 1.1B model takes a while)."""
    import json

    import transformers

    config = shape.config()
    if folder and os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f)
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")  # fmt: skip
        if all(saved.get(k) == getattr(config, k) for k in keys):
            return folder
    folder = folder or tempfile.mkdtemp(prefix="rs-decode-bw-")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    return folder


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model, batches 1,2 x contexts 16,40: checks the script (CPU)")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batches", type=ints, default=None, help="default 1,8,32,128")
    ap.add_argument("--contexts", type=ints, default=None, help="default 512,4096")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per cell")
    ap.add_argument("--copy-mib", type=int, default=None, help="copy size (GPU 1024, CPU 64)")
    ap.add_argument("--model-dir", default=None,
                    help="save the random model here, or reuse the one of this shape there")  # fmt: skip
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--sync-debug", action="store_true",
                    help="3 steady-state forwards per cell under sync-debug 'error'")  # fmt: skip
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 below {GOAL * 100:.0f}%% of the copy at the largest cell")  # fmt: skip
    args = ap.parse_args(argv)
    shape = TINY if args.tiny else GPU_1B
    if args.layers:
        shape = LlamaShape(**{**shape.__dict__, "layers": args.layers})
    batches = args.batches or ([1, 2] if args.tiny else [1, 8, 32, 128])
    contexts = args.contexts or ([16, 40] if args.tiny else [512, 4096])
    device = torch.device(args.device)
    if args.sync_debug and device.type != "cuda":
        print("--sync-debug: no CUDA device, the forwards run without the sync check")

    dtype = getattr(torch, args.dtype)
    folder = make_model(shape, dtype, args.model_dir)
    room = args.steps + 8
    max_b = max(batches)
    pages = max_b * -(-(max(contexts) + room + 1) // args.page_size)
    runner = build_runner(WorkerConfig(
        model=folder, device=args.device, dtype=args.dtype, page_size=args.page_size,
        num_pages=pages, max_running_requests=max_b, attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
    ))  # fmt: skip
    elem = dtype.itemsize
    kv_elem = runner.pool.layers[0].element_size()
    pool_per_token = sum(x[0].numel() * x.element_size() for x in runner.pool.layers)
    if pool_per_token != shape.kv_bytes_per_token(kv_elem) * args.page_size:
        raise SystemExit(f"KV bytes per page {pool_per_token} != the shape's")
    if runner.weight_bytes != shape.parameters() * elem:
        raise SystemExit(f"weight bytes {runner.weight_bytes} != {shape.parameters() * elem}")
    for layer in runner.pool.layers:
        layer.normal_()
    copy_bw = copy_bandwidth(
        device, (args.copy_mib or (1024 if device.type == "cuda" else 64)) << 20
    )
    graphs = list(runner.graphs.sizes) if runner.graphs else "none"
    print(f"model: random Llama {shape.parameters() / 1e9:.2f}B parameters ({shape}), "
          f"{args.dtype}, {args.device}, page_size {args.page_size}, backend "
          f"{runner.backend_name}, graphs {graphs}")  # fmt: skip
    print(f"copy bandwidth (device to device, read + write): {copy_bw / 1e9:.1f} GB/s\n")
    print("| batch | context | step ms | weights MB |    KV MB | GB/s | of copy |")
    print("|------:|--------:|--------:|-----------:|---------:|-----:|--------:|")
    last = 0.0
    for context in contexts:
        for b in batches:
            dec = Decoder(runner, b, context, room)
            try:
                dec.step()  # registers the slots
                dec.step()  # warm (a first replay, allocations)
                if args.sync_debug:
                    for _ in range(3):
                        dec.forward_without_sync()
                times, moved = [], []
                for _ in range(args.steps):
                    before = list(dec.pos)
                    times.append(dec.step())
                    moved.append(step_bytes(shape, before, elem, kv_elem))
            finally:
                dec.close()
            t = statistics.median(times)
            w = moved[0]["weights"]
            kv = statistics.mean(m["kv_read"] + m["kv_write"] for m in moved)
            bw = (w + kv) / t
            last = bw / copy_bw
            print(f"| {b:>5} | {context:>7} | {t * 1e3:>7.3f} | {w / 1e6:>10.3f} | "
                  f"{kv / 1e6:>8.3f} | {bw / 1e9:>4.0f} | {last:>7.1%} |")  # fmt: skip
    if args.sync_debug and device.type == "cuda":
        print("\nsync debug: no host sync in the decode forwards")
    print(f"\nbatch {batches[-1]} x context {contexts[-1]}: {last:.1%} of the copy "
          f"(goal on a GPU: >= {GOAL:.0%})")  # fmt: skip
    if args.check and last < GOAL:
        print("FAIL: below the goal")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
