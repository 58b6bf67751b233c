"""``radixserve bench WORKLOAD [options]``: build the workload, run it against one or
more servers, print the table, write the JSON and the PNG.

Targets, one of:
- ``--compare KEY=V1,V2`` (repeatable: the cross product): one fresh
  ``radixserve launch`` per variant, back to back, each with ``--KEY V`` added
  to ``--server-args``;
- ``--endpoint tcp://...``: a running radixserve server;
- ``--backend openai --base-url http://HOST:PORT/v1``: any OpenAI-compatible server;
- nothing: one fresh server launched with ``--server-args``.
Every variant gets the same prompts (one workload, one seed).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixserve.benchmark import report
from radixserve.benchmark.backends import Backend, OpenAIBackend, RadixserveBackend
from radixserve.benchmark.metrics import summarize
from radixserve.benchmark.runner import run
from radixserve.benchmark.server import LaunchedServer
from radixserve.benchmark.workloads import (
    BUILDERS,
    WORKLOADS,
    TokenSource,
    Workload,
    from_tokenizer,
)

# Workload flags: each builder takes the ones named in its signature.
WORKLOAD_FLAGS: list[tuple[str, type, str]] = [
    ("groups", int, "shared-prefix: groups (distinct system prompts)"),
    ("prompts", int, "shared-prefix: prompts per group"),
    ("system-len", int, "shared-prefix, multi-turn: system prompt tokens"),
    ("question-len", int, "shared-prefix, few-shot: question tokens"),
    ("output-len", int, "output tokens per request (ignore_eos: exact)"),
    ("order", str, "shared-prefix: shuffled | ordered arrival"),
    ("conversations", int, "multi-turn: conversations (run concurrently)"),
    ("turns", int, "multi-turn: turns per conversation (sequential)"),
    ("user-len-min", int, "multi-turn: shortest user message"),
    ("user-len-max", int, "multi-turn: longest user message"),
    ("answer", str, "multi-turn: short (32 tokens) | long (256 tokens)"),
    ("subjects", int, "few-shot: subjects (distinct example sets)"),
    ("questions", int, "few-shot: questions per subject"),
    ("shots", int, "few-shot: examples per prompt"),
    ("example-len", int, "few-shot: tokens per example"),
    ("trees", int, "tree: independent trees"),
    ("depth", int, "tree: levels below the root"),
    ("branches", int, "tree: continuations per answer"),
    ("root-len", int, "tree: root prompt tokens"),
    ("branch-len", int, "tree: tokens each branch adds"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", choices=WORKLOADS)
    w = p.add_argument_group("workload (defaults: docs/benchmark.md)")
    for name, typ, text in WORKLOAD_FLAGS:
        w.add_argument(f"--{name}", type=typ, default=None, help=text)
    w.add_argument(
        "--prompt-kind",
        choices=["random", "text"],
        default="random",
        help="random token ids, or real English (pydoc_data.topics) tokenized",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")

    r = p.add_argument_group("arrival")
    r.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s (default: all at once)",
    )
    r.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    r.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrelated requests sent first (then the cache is flushed)",
    )
    r.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")

    t = p.add_argument_group("target")
    t.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="launch one server per value of launch flag --KEY (repeatable)",
    )
    t.add_argument(
        "--server-args", default="", help='launch flags for launched servers, e.g. "--page-size 16"'
    )
    t.add_argument("--model", default="smollm2", help="model of launched servers and tokenizer")
    t.add_argument("--tokenizer", default=None, help="tokenizer (model name/path); default --model")
    t.add_argument("--backend", choices=["radixserve", "openai"], default="radixserve")
    t.add_argument("--endpoint", default=None, help="a running radixserve server (tcp://...)")
    t.add_argument("--base-url", default=None, help="openai: e.g. http://127.0.0.1:8000/v1")
    t.add_argument("--served-model", default=None, help="openai: model name (default: /models)")
    t.add_argument(
        "--server-page-size",
        type=int,
        default=1,
        help="openai: the server's cache block size, for the optimal hit rate",
    )
    t.add_argument(
        "--extra-body",
        default=None,
        help="openai: JSON merged into each request, e.g. '{\"return_token_ids\": true}'",
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--output",
        default=None,
        help="path prefix of the .json and .png (default bench/results/WORKLOAD-TIME)",
    )
    o.add_argument("--no-plot", action="store_true", help="skip the PNG")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_workload(args: argparse.Namespace, src: TokenSource) -> Workload:
    builder = BUILDERS[args.workload]
    accepted = set(inspect.signature(builder).parameters) - {"src"}
    params = {}
    for name, _, _ in WORKLOAD_FLAGS:
        key = name.replace("-", "_")
        value = getattr(args, key)
        if value is None:
            continue
        if key not in accepted:
            raise SystemExit(f"radixserve bench: --{name} does not apply to {args.workload}")
        params[key] = value
    return builder(src, **params)


def variants(args: argparse.Namespace) -> list[tuple[str, list[str] | None]]:
    """(label, launch flags) per variant; flags None: an existing server."""
    if args.endpoint or args.backend == "openai":
        if args.compare:
            raise SystemExit(
                "radixserve bench: --compare launches servers; drop --endpoint/--base-url"
            )
        return [(args.endpoint or args.base_url or "openai", None)]
    base = ["--model", args.model, *shlex.split(args.server_args)]
    if not args.compare:
        return [("launched", base)]
    axes = []
    for spec in args.compare:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise SystemExit(f"radixserve bench: --compare wants KEY=V1,V2, got {spec!r}")
        axes.append([(key, v) for v in values.split(",")])
    out = []
    for combo in itertools.product(*axes):
        label = ",".join(f"{k}={v}" for k, v in combo)
        out.append((label, base + [a for k, v in combo for a in (f"--{k}", v)]))
    return out


def make_backend(args: argparse.Namespace, endpoint: str | None) -> Backend:
    if args.backend == "openai":
        if not args.base_url:
            raise SystemExit("radixserve bench: --backend openai needs --base-url")
        extra = json.loads(args.extra_body) if args.extra_body else None
        return OpenAIBackend(
            args.base_url, args.served_model, args.server_page_size, extra, timeout=args.timeout
        )
    return RadixserveBackend(endpoint or args.endpoint, timeout=args.timeout)


async def run_variant(
    args: argparse.Namespace, workload: Workload, endpoint: str | None, label: str, tokenizer: Any
) -> dict[str, Any]:
    backend = make_backend(args, endpoint)
    try:
        info = await backend.info()
        need = workload.max_prompt_len()
        if info.max_context_len is not None and need > info.max_context_len:
            raise SystemExit(
                f"radixserve bench: the workload needs {need} tokens of context, "
                f"the server has {info.max_context_len}: scale it down"
            )
        warm = TokenSource.random(len(tokenizer), args.seed + 1, tokenizer.all_special_ids)
        for _ in range(args.warmup):
            async for _ev in backend.stream(warm.take(16), 4):
                pass
        flushed = await backend.reset_cache()
        before = await backend.stats()
        result = await run(
            workload,
            backend,
            rate=args.rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            progress=not args.no_progress,
            label=label,
        )
        after = await backend.stats()
    finally:
        await backend.close()
    return {
        "label": label,
        "backend": backend.name,
        "model": info.model,
        "page_size": info.page_size,
        "cache_flushed_before_run": flushed,
        "stats_before": before,
        "stats_after": after,
        "metrics": summarize(result, info.page_size),
        "requests": report.request_rows(result.records),
    }


def title(workload: Workload, args: argparse.Namespace) -> str:
    params = " ".join(f"{k}={v}" for k, v in workload.params.items())
    arrival = f"Poisson {args.rate}/s" if args.rate else "all at once"
    conc = f", concurrency {args.max_concurrency}" if args.max_concurrency else ""
    return (
        f"{workload.name}: {workload.num_requests} requests ({params}), "
        f"{args.prompt_kind} prompts, {arrival}{conc}"
    )


def _require(module: str, why: str) -> None:
    """Fail before a long run, not after it, when an optional package is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"radixserve bench: {why} needs {module}: pip install {module}")


def main(args: argparse.Namespace) -> int:
    from radixserve.models.tokenizer import load_tokenizer

    if not args.no_plot:
        _require("matplotlib", "the PNG plot (or pass --no-plot)")
    if args.backend == "openai":
        _require("httpx", "--backend openai")
    plan = variants(args)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    workload = build_workload(args, from_tokenizer(tokenizer, args.prompt_kind, args.seed))
    results = []
    for label, launch_args in plan:
        if launch_args is None:
            results.append(asyncio.run(run_variant(args, workload, None, label, tokenizer)))
            continue
        print(f"radixserve bench: launching {label}: {' '.join(launch_args)}", file=sys.stderr)
        with LaunchedServer(launch_args) as server:
            v = asyncio.run(run_variant(args, workload, server.endpoint, label, tokenizer))
        v["server_args"], v["server_summary"] = launch_args, server.summary
        results.append(v)

    head = title(workload, args)
    print(report.table(head, results))
    prefix = Path(args.output or f"bench/results/{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    doc = {
        "title": head,
        "workload": workload.name,
        "workload_params": workload.params,
        "num_requests": workload.num_requests,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "argv": sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "variants": results,
    }
    json_path, png_path = Path(f"{prefix}.json"), Path(f"{prefix}.png")
    report.write_json(json_path, doc)
    written = [str(json_path)]
    if not args.no_plot:
        report.write_png(png_path, head, results)
        written.append(str(png_path))
    print("wrote " + ", ".join(written))
    return 1 if any(v["metrics"]["failed"] or v["metrics"]["not_sent"] for v in results) else 0


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m radixserve.benchmark.cli`` is the same as ``radixserve bench``."""
    p = argparse.ArgumentParser(prog="radixserve bench")
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
