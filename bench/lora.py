"""Throughput with LoRA adapters mixed in one batch against the base model alone.

A random Llama-shaped float32 model (``--hidden``, ``--layers``) and ``max(--adapters)``
random PEFT-format adapters of rank ``--rank`` on all seven projections (written here
with safetensors, as PEFT lays them out). Each config runs the same prompts through the
scheduler and the worker in this process (the Engine's loop, without detokenizing):
``--prompts`` random prompts of ``--prompt-len`` tokens, ``--gen`` greedy tokens each
(``ignore_eos``), all submitted at once, the cache flushed before each run so every
prompt is computed. Configs:

- ``base``: no adapter (decode steps take the one-call native decode step where the
  CPU allows);
- ``base, one-call decode off``: the same with ``decode_step.ENABLED = False``, the path
  every step with adapter rows takes (docs/lora.md), so the two rows split the cost into
  the path and the LoRA products;
- ``N adapters``: request i under adapter ``i % N`` (``--max-loras`` = the largest N).

Configs are interleaved round by round (``--rounds``) and the table gives each one's
median seconds, output tokens per second, and the median of its per-round ratio to
``base``, by wall time and by this process's CPU time (ratios only: the machine is
shared and noisy; under other jobs' load the CPU-time ratio moves less).

    python bench/lora.py --adapters 1,4,8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
        "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def random_model(folder: str, hidden: int, layers: int, inter: int, vocab: int) -> dict:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    print(f"random Llama: {n / 1e6:.1f}M parameters, hidden {hidden}, {layers} layers")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def write_adapter(folder: str, shapes: dict, layers: int, rank: int, seed: int) -> None:
    """A PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, part in PROJ.items():
            out, fan_in = shapes[f"model.layers.{i}.{part}.{proj}.weight"]
            key = f"base_model.model.model.layers.{i}.{part}.{proj}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[key + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ),
              "bias": "none", "use_rslora": False, "use_dora": False}  # fmt: skip
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def run_once(runner, scheduler, prompts, loras, gen) -> tuple[float, float]:
    from radixserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    scheduler.flush_cache()
    t, cpu = time.perf_counter(), time.process_time()
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        scheduler.add_request(f"r{time.monotonic_ns()}-{i}", p, sp, lora=lora)
    done = 0
    while scheduler.has_work():
        for out in scheduler.step(runner.step):
            done += out.finish_reason is not None
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    assert done == len(prompts), (done, len(prompts))
    return elapsed, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from radixserve.compose import build_scheduler, build_worker
    from radixserve.config import EngineConfig
    from radixserve.models import decode_step

    counts = [int(x) for x in args.adapters.split(",") if x]
    tmp = tempfile.mkdtemp(prefix="rs-lora-bench-")
    model_dir = os.path.join(tmp, "base")
    shapes = random_model(model_dir, args.hidden, args.layers, args.intermediate, args.vocab)
    mods = []
    for j in range(max(counts)):
        path = os.path.join(tmp, f"lora{j}")
        write_adapter(path, shapes, args.layers, args.rank, seed=j + 1)
        mods.append(f"l{j}={path}")
    config = EngineConfig(
        model=model_dir, dtype="float32", page_size=16, num_pages=4096,
        chunked_prefill_size=2048, max_running_requests=64, lora_modules=tuple(mods),
        max_loras=max(counts), max_lora_rank=args.rank,
    )  # fmt: skip
    runner = build_worker(config)
    scheduler = build_scheduler(config, runner.info())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    configs: list[tuple[str, list, bool]] = [
        ("base", [None] * len(prompts), True),
        ("base, one-call decode off", [None] * len(prompts), False),
    ]
    for n in counts:
        label = f"{n} adapter" + ("s" if n > 1 else "")
        configs.append((label, [f"l{i % n}" for i in range(len(prompts))], True))
    times: dict[str, list[float]] = {c[0]: [] for c in configs}
    cpus: dict[str, list[float]] = {c[0]: [] for c in configs}
    load = [os.getloadavg()[0]]
    run_once(runner, scheduler, prompts, configs[0][1], args.gen)  # warm every path once
    for _ in range(args.rounds):
        for label, loras, native in configs:
            decode_step.ENABLED = native
            try:
                wall, cpu = run_once(runner, scheduler, prompts, loras, args.gen)
                times[label].append(wall)
                cpus[label].append(cpu)
            finally:
                decode_step.ENABLED = True
    load.append(os.getloadavg()[0])
    out_tokens = len(prompts) * args.gen
    base, base_cpu = times["base"], cpus["base"]
    print(f"\n{len(prompts)} prompts x {args.prompt_len} tokens, {args.gen} greedy tokens each, "
          f"rank {args.rank} on q/k/v/o/gate/up/down, float32, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds; load average {load[0]:.1f} -> {load[1]:.1f}\n")  # fmt: skip
    print(
        "| config | median s | output tok/s | throughput vs base | median CPU s | vs base by CPU time |"
    )
    print("|---|---|---|---|---|---|")
    for label, _, _ in configs:
        med, cpu = statistics.median(times[label]), statistics.median(cpus[label])
        ratio = statistics.median(b / t for b, t in zip(base, times[label]))
        cpu_ratio = statistics.median(b / t for b, t in zip(base_cpu, cpus[label]))
        print(f"| {label} | {med:.2f} | {out_tokens / med:.0f} | {ratio:.2f}x | {cpu:.2f} "
              f"| {cpu_ratio:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
