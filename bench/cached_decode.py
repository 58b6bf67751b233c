"""Decode steps over a cached shared prefix: the all-cached repeat, variants taking turns.

The offline shared-prefix workload of ``bench/engine_trials.py`` (P prompts sharing
one S-token system prompt plus Q-token questions, O output tokens, greedy,
``ignore_eos``; with ``--groups G``, G groups of P / G prompts, each group with
its own system prompt, so a decode step holds G cascade groups) through one
in-process Engine with default flags. A first run
fills the cache; then every round runs the same prompts again once per variant
(nothing flushed: everything but the questions is cached, so the run is one
short prefill and O - 1 decode steps at batch P). Variants switch the CPU
products' choices inside this process (``layers/cpu_kernels.py``):

- ``amx=0|1``: ``cpu_kernels.AMX`` (bfloat16 products of 2+ rows through oneDNN's
  AMX code, or through the skinny kernel);
- ``isa=LEVEL``: ``cpu_kernels.ISA``;
- ``flash=0|1``: the attention backend's ``shared_prefix_flash`` (the shared
  prefix through torch's CPU flash attention, or through the native kernel);
- ``layers=0|1``: ``models.decode_step.ENABLED`` (every layer of a decode step in
  one native call where it can, or the layers one by one in Python);
- ``det=0|1``: deterministic mode (``--deterministic``: batch-invariant products and
  attention, docs/deterministic.md), switched in the running worker.

Each variant is a comma-separated list of those, ``;`` between variants ("" is the
process's own choice). The table gives per variant the median over rounds of the
repeat's seconds and of its median decode step (a step whose requests all decode
one token), and each variant's ratio to the first within each round (median; a
drift in the machine's speed hits all variants alike).

    python bench/cached_decode.py --variants "amx=0;amx=1" --threads 1

``--tree DIR`` (repeatable) compares checkouts instead (an older commit exported to
DIR with its native extensions built or copied): each tree runs this script with
default variants in fresh processes, with ``PYTHONPATH=DIR``, the trees taking
turns ``--processes`` times; the table gives each tree's median repeat and decode
step over all its rounds and its ratio to the first tree (median over the turns).

    python bench/cached_decode.py --tree /tmp/old --tree . --processes 2 --threads 1

``--profile N`` runs the first variant once more under cProfile after the rounds
and prints the N functions with the most own time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from radixserve.layers import cpu_kernels
from radixserve.models import decode_step


def parse_variant(text: str) -> dict:
    out: dict = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition("=")
        if name == "amx":
            out["AMX"] = value == "1"
        elif name == "isa":
            out["ISA"] = cpu_kernels.resolve_isa(value)
        elif name == "flash":
            out["flash"] = value == "1"
        elif name == "layers":
            out["layers"] = value == "1"
        elif name == "det":
            out["det"] = value == "1"
        else:
            raise SystemExit(f"unknown variant key {name!r} (amx, isa, flash, layers, det)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="", help='e.g. "amx=0;amx=1"')
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=32, help="in all, over the groups")
    ap.add_argument("--groups", type=int, default=1, help="system prompts (cascade groups)")
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=30)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", help="write the per-round timings here")
    ap.add_argument("--tree", action="append", help="compare these checkouts (see above)")
    ap.add_argument("--processes", type=int, default=2, help="turns per tree with --tree")
    ap.add_argument("--profile", type=int, default=0, help="print this many cProfile rows")
    args = ap.parse_args()
    if args.tree:
        return compare_trees(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from radixserve import Engine, SamplingParams
    from radixserve.benchmark.workloads import TokenSource, shared_prefix
    from radixserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    src = TokenSource.random(len(tok), args.seed, exclude=tok.all_special_ids)
    if args.groups < 1 or args.prompts % args.groups:
        raise SystemExit("--prompts must be a multiple of --groups")
    per_group = args.prompts // args.groups
    work = shared_prefix(
        src, args.groups, per_group, args.system_len, args.question_len, args.output_len
    )
    prompts = [node.tokens for node in work.roots]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine = Engine(model=args.model)
    step_times: list[float] = []
    run_step = engine.runner.step

    def timed_step(batch):
        t = time.perf_counter()
        out = run_step(batch)
        if batch.reqs and all(len(r.input_ids) == 1 for r in batch.reqs):
            step_times.append(time.perf_counter() - t)
        return out

    engine.runner.step = timed_step  # type: ignore[method-assign]
    first = engine.generate(prompts, sp)[0].token_ids[:8]
    variants = [(v.strip(), parse_variant(v)) for v in args.variants.split(";")]
    backend = engine.runner.backend
    own = {"AMX": getattr(cpu_kernels, "AMX", False), "ISA": cpu_kernels.ISA}
    own_flash = getattr(backend, "shared_prefix_flash", False)
    own_prefill = getattr(backend, "native_prefill_max_tokens", 0)
    own_config = engine.runner.config
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in variants}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, setting in variants:
            setting = {"flash": own_flash, "layers": True, "det": False, **own, **setting}
            det = setting.pop("det")
            backend.shared_prefix_flash = setting.pop("flash") and not det
            decode_step.ENABLED = setting.pop("layers")
            # Deterministic mode, as the worker would be built with --deterministic.
            backend.deterministic = det
            backend.native_prefill_max_tokens = 1 << 62 if det else own_prefill
            engine.runner.config = dataclasses.replace(own_config, deterministic=det)
            for key, value in setting.items():
                setattr(cpu_kernels, key, value)
            step_times.clear()
            t = time.perf_counter()
            results = engine.generate(prompts, sp)
            runs[name].append((time.perf_counter() - t, statistics.median(step_times)))
            tokens[name] = results[0].token_ids[:8]
    if args.profile:
        profile_repeat(engine, prompts, sp, args.profile)
    info = engine.runner.info()
    engine.close()
    print(f"{args.prompts} prompts in {args.groups} group(s) x {args.system_len}-token shared "
          f"prefix, {args.output_len} "
          f"tokens, {info.dtype}, {torch.get_num_threads()} threads, isa {own['ISA']}, "
          f"AMX {own['AMX']}, flash {own_flash}; first run's tokens {first}")  # fmt: skip
    print("| variant | repeat s | decode step ms | repeat vs first | step vs first | tokens |")
    print("|---|---|---|---|---|---|")
    base = runs[variants[0][0]]
    for name, _ in variants:
        rs = runs[name]
        ratio_r = statistics.median(b[0] / r[0] for b, r in zip(base, rs))
        ratio_s = statistics.median(b[1] / r[1] for b, r in zip(base, rs))
        print(f"| {name or '(own)'} | {statistics.median(r[0] for r in rs):.3f} | "
              f"{statistics.median(r[1] for r in rs) * 1e3:.1f} | {ratio_r:.2f}x | "
              f"{ratio_s:.2f}x | {tokens[name]} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "tokens": tokens, "first": first}, f)


def profile_repeat(engine, prompts: list, sp, rows: int) -> None:
    """One more repeat under cProfile: the functions with the most own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, sp)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


def compare_trees(args: argparse.Namespace) -> None:
    """Each tree in fresh processes, the trees taking turns; one table with ratios."""
    trees = [os.path.abspath(t) for t in args.tree]
    passed = ["--rounds", str(args.rounds), "--prompts", str(args.prompts), "--groups",
              str(args.groups), "--system-len",
              str(args.system_len), "--question-len", str(args.question_len), "--output-len",
              str(args.output_len), "--seed", str(args.seed), "--model", args.model]  # fmt: skip
    if args.threads:
        passed += ["--threads", str(args.threads)]
    turns: dict[str, list[dict]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.processes):
            for i, tree in enumerate(trees):
                out = os.path.join(tmp, f"{turn}-{i}.json")
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, os.path.abspath(__file__), *passed, "--json", out]
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    turns[tree].append(json.load(f))
    print(f"{args.prompts} prompts in {args.groups} group(s) x {args.system_len}-token shared "
          f"prefix, {args.output_len} tokens, {args.threads or 'default'} threads, {args.processes} processes per tree "
          f"x {args.rounds} rounds")  # fmt: skip
    print("| tree | repeat s | decode step ms | repeat vs first | step vs first | tokens |")
    print("|---|---|---|---|---|---|")

    def medians(turn: dict) -> tuple[float, float]:
        [rs] = turn["runs"].values()
        return statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)

    base = [medians(t) for t in turns[trees[0]]]
    for tree in trees:
        ms = [medians(t) for t in turns[tree]]
        rounds = [r for t in turns[tree] for r in next(iter(t["runs"].values()))]
        ratio_r = statistics.median(b[0] / m[0] for b, m in zip(base, ms))
        ratio_s = statistics.median(b[1] / m[1] for b, m in zip(base, ms))
        [tokens] = turns[tree][-1]["tokens"].values()
        print(f"| {tree} | {statistics.median(r[0] for r in rounds):.3f} | "
              f"{statistics.median(r[1] for r in rounds) * 1e3:.1f} | {ratio_r:.2f}x | "
              f"{ratio_s:.2f}x | {tokens} |")  # fmt: skip


if __name__ == "__main__":
    main()
