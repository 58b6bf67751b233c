"""``radixserve bench WORKLOAD [options]``: build the workload, run it against one or
more servers, print the table, write the JSON and the PNG.

Targets, one of:
- ``--compare KEY=V1,V2`` (repeatable: the cross product): one fresh
  ``radixserve launch`` per variant, back to back, each with ``--KEY V`` added
  to ``--server-args`` (``_`` in KEY reads as ``-``; a boolean flag takes
  true/false and becomes ``--KEY`` or ``--no-KEY``);
- ``--endpoint tcp://...``: a running radixserve server;
- ``--backend openai --base-url http://HOST:PORT/v1``: any OpenAI-compatible server;
- ``--backend engine``: an in-process ``Engine`` per variant, built from
  ``--model``, ``--server-args`` and the ``--compare`` flags as a launch would be;
- nothing: one fresh server launched with ``--server-args``.
Every variant gets the same prompts (one workload, one seed).

``program`` runs the prompt programs of docs/programs.md instead of a fixed tree of
prompts (``benchmark/programs.py``): the same targets, the same table.

``multimodal`` asks questions about images behind a shared system prompt
(``benchmark/multimodal.py``, a vision-language model): the same table, plus the TTFT
of cold and repeated images and the vision encoder's runs.

``few-shot --score`` scores multiple-choice questions instead of generating,
and runs each target twice: prompt logprobs from each choice's start (the cache
serves the context and question), then from position 0 (the whole prompt
recomputed, as a client without a start position must); the table shows both.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections.abc import Sequence
from typing import Any

from radixserve.benchmark import multimodal, programs, report
from radixserve.benchmark.backends import (
    Backend,
    EngineBackend,
)
from radixserve.benchmark.metrics import compare_scores, compare_texts, step_summary, summarize
from radixserve.benchmark.runner import run
from radixserve.benchmark.server import LaunchedServer
from radixserve.benchmark.targets import make_backend, make_engine, variants
from radixserve.benchmark.workloads import (
    BUILDERS,
    SCORE_BUILDERS,
    WORKLOADS,
    TokenSource,
    Workload,
    from_tokenizer,
    mix_priorities,
)

# Scoring workloads run twice per target: (label, the runner's score_from).
SCORE_PASSES = [("from-choice", "choice"), ("whole-prompt", "whole")]
# The agent workload runs twice per target: without, then with its retention hints.
AGENT_PASSES = [("no retention", False), ("retention", True)]

# Workload flags: each builder takes the ones named in its signature.
WORKLOAD_FLAGS: list[tuple[str, type, str]] = [
    ("groups", int, "shared-prefix: groups (distinct system prompts)"),
    ("prompts", int, "shared-prefix: prompts per group"),
    (
        "system-len",
        int,
        "shared-prefix, multi-turn, agent: system prompt tokens; multimodal: words",
    ),
    (
        "question-len",
        int,
        "shared-prefix, few-shot, json-extract: question tokens; multimodal: words",
    ),
    (
        "output-len",
        int,
        "output tokens per request (ignore_eos: exact; json-extract: at most; program: per gen)",
    ),
    ("order", str, "shared-prefix: shuffled | ordered arrival"),
    ("conversations", int, "multi-turn: conversations (run concurrently)"),
    ("turns", int, "multi-turn, agent: turns per conversation (sequential)"),
    ("user-len-min", int, "multi-turn: shortest user message; agent: tool result"),
    ("user-len-max", int, "multi-turn: longest user message; agent: tool result"),
    ("answer", str, "multi-turn: short (32 tokens) | long (256 tokens)"),
    ("subjects", int, "few-shot: subjects (distinct example sets)"),
    (
        "questions",
        int,
        "few-shot: questions per subject; json-extract: per document; multimodal: per image",
    ),
    ("shots", int, "few-shot: examples per prompt"),
    ("example-len", int, "few-shot: tokens per example"),
    ("trees", int, "tree: independent trees"),
    ("depth", int, "tree: levels below the root"),
    ("branches", int, "tree: continuations per answer"),
    ("root-len", int, "tree: root prompt tokens"),
    ("branch-len", int, "tree: tokens each branch adds"),
    ("choices", int, "few-shot --score: choices per question"),
    ("choice-len", int, "few-shot --score: most tokens per choice (each has 1 to this many)"),
    ("documents", int, "json-extract: documents (each shared by its questions); copy: prompts"),
    ("document-len", int, "json-extract, copy: tokens per document"),
    ("repeats", int, "copy: times each prompt is sent in a row (the same request recurring)"),
    ("sessions", int, "agent: sessions (run concurrently)"),
    ("context-len", int, "agent: each session's own task tokens"),
    ("pause", float, "agent: seconds a tool runs between a session's turns"),
    ("noise", int, "agent: one-off requests spread over the sessions' span"),
    ("noise-len", int, "agent: tokens per one-off request"),
    ("retention-s", float, "agent: seconds each session request asks to be kept"),
    ("images", int, "multimodal: images (each asked --questions questions)"),
    ("image-size", str, "multimodal: WxH pixels of each image"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", choices=[*WORKLOADS, "program", "multimodal"])
    w = p.add_argument_group("workload (defaults: docs/benchmark.md)")
    for name, typ, text in WORKLOAD_FLAGS:
        w.add_argument(f"--{name}", type=typ, default=None, help=text)
    w.add_argument(
        "--prompt-kind",
        choices=["random", "text"],
        default="random",
        help="random token ids, or real English (pydoc_data.topics) tokenized",
    )
    w.add_argument(
        "--program",
        choices=[*programs.PROGRAMS, "all"],
        default="all",
        help="program: which prompt program (docs/programs.md) to run",
    )
    w.add_argument("--programs", type=int, default=4, help="program: programs of each kind")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    w.add_argument(
        "--score",
        action="store_true",
        help="few-shot: score multiple-choice questions (prompt logprobs of each choice), "
        "once from the choice's start and once over the whole prompt",
    )

    r = p.add_argument_group("arrival")
    r.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests/s (program: programs/s; default: all at once)",
    )
    r.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (program: programs)",
    )
    r.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrelated requests sent first (then the cache is flushed)",
    )
    r.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")

    q = p.add_argument_group("priorities (docs/benchmark.md#priorities)")
    q.add_argument(
        "--priority-mix",
        type=float,
        default=None,
        metavar="SHARE",
        help="send this share of the roots (with their follow-ups) at --priority-level; "
        "the table adds TTFT per class",
    )
    q.add_argument(
        "--priority-level",
        type=int,
        default=-1,
        help="the urgent class's priority (lower goes first; the rest send 0)",
    )
    q.add_argument(
        "--retention",
        default=None,
        metavar="LEVEL:SECONDS",
        help="the urgent class also sends cache_retention [LEVEL, SECONDS] "
        "(kept under --radix-eviction-policy priority)",
    )

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
    t.add_argument(
        "--backend",
        choices=["radixserve", "openai", "engine"],
        default="radixserve",
        help="engine: an in-process Engine per variant (no server)",
    )
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
        "--text-prompts",
        action="store_true",
        help="openai: send prompts as text (decoded with --tokenizer) to servers that take "
        "no token ids, e.g. llama-cpp-python's; the end-of-text token gets a -100 logit bias",
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
    if getattr(args, "score", False):
        if args.workload not in SCORE_BUILDERS:
            raise SystemExit(f"radixserve bench: --score does not apply to {args.workload}")
        builder = SCORE_BUILDERS[args.workload]
    accepted = set(inspect.signature(builder).parameters) - {"src"}
    params = {}
    for name, _, _ in WORKLOAD_FLAGS:
        key = name.replace("-", "_")
        value = getattr(args, key)
        if value is None:
            continue
        if key not in accepted:
            mode = " --score" if getattr(args, "score", False) else ""
            raise SystemExit(f"radixserve bench: --{name} does not apply to {args.workload}{mode}")
        params[key] = value
    workload = builder(src, **params)
    if getattr(args, "priority_mix", None) is not None:
        try:
            mix_priorities(
                workload,
                args.priority_mix,
                args.priority_level,
                _retention(args.retention),
                args.seed,
            )
        except ValueError as e:
            raise SystemExit(f"radixserve bench: {e}") from None
    return workload


def _retention(text: str | None) -> tuple[int, float] | None:
    if text is None:
        return None
    level, sep, seconds = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(level), float(seconds)
    except ValueError:
        raise ValueError(f"--retention takes LEVEL:SECONDS, got {text!r}") from None


async def run_variant(
    args: argparse.Namespace,
    workload: Workload,
    backend: Backend,
    label: str,
    tokenizer: Any,
    prefix: str = "",
) -> list[dict[str, Any]]:
    """One target: the workload once, a scoring workload once per SCORE_PASSES, the
    agent workload once per AGENT_PASSES (labelled ``prefix + pass``), each from a
    flushed cache. Each dict keeps the run's records under ``_records`` (not written
    to the JSON)."""
    passes = [(label, "choice", True)]
    if workload.scored:
        passes = [(prefix + name, mode, True) for name, mode in SCORE_PASSES]
    elif workload.name == "agent":
        passes = [(prefix + name, "choice", hints) for name, hints in AGENT_PASSES]
    out = []
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
        for pass_label, score_from, hints in passes:
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
                label=pass_label,
                score_from=score_from,
                retention=hints,
            )
            after = await backend.stats()
            metrics = summarize(result, info.page_size, workload)
            metrics.update(step_summary(before, after, metrics["requests"]))
            metrics["hybrid"] = bool((after or {}).get("state_snapshots"))
            v = {
                "label": pass_label,
                "backend": backend.name,
                "model": info.model,
                "page_size": info.page_size,
                "cache_flushed_before_run": flushed,
                "stats_before": before,
                "stats_after": after,
                "metrics": metrics,
                "requests": report.request_rows(result.records, texts=workload.structured),
                "_records": result.records,
            }
            if workload.scored:
                v["score_from"] = score_from
            figures = await backend.dashboard()
            if figures is not None:  # the cache's largest prefixes now (report.write_tree)
                v["tree"] = figures["tree"]
            out.append(v)
    finally:
        await backend.close()
    return out


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
    if args.workload == "program":
        return programs.main(args, [name for name, _, _ in WORKLOAD_FLAGS])
    if args.workload == "multimodal":
        return multimodal.main(args, [name for name, _, _ in WORKLOAD_FLAGS])
    if args.backend == "openai":
        _require("httpx", "--backend openai")
    if args.workload == "json-extract":
        _require("jsonschema", "json-extract's validity check")
    plan = variants(args)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    workload = build_workload(args, from_tokenizer(tokenizer, args.prompt_kind, args.seed))
    results: list[dict[str, Any]] = []
    for label, launch_args in plan:
        prefix = f"{label} " if len(plan) > 1 else ""
        if launch_args is None:
            backend = make_backend(args, None)
            results += asyncio.run(run_variant(args, workload, backend, label, tokenizer, prefix))
            continue
        if args.backend == "engine":
            print(f"radixserve bench: engine {label}: {' '.join(launch_args)}", file=sys.stderr)
            engine = make_engine(launch_args)
            try:
                vs = asyncio.run(
                    run_variant(args, workload, EngineBackend(engine), label, tokenizer, prefix)
                )
            finally:
                engine.close()
            summary = f"engine {engine.config.model}"
        else:
            print(f"radixserve bench: launching {label}: {' '.join(launch_args)}", file=sys.stderr)
            with LaunchedServer(launch_args) as server:
                backend = make_backend(args, server.endpoint)
                vs = asyncio.run(run_variant(args, workload, backend, label, tokenizer, prefix))
            summary = server.summary
        for v in vs:
            v["server_args"], v["server_summary"] = launch_args, summary
        results += vs
    if workload.scored:  # the same requests' scores against the first column's
        first = results[0]["_records"]
        for v in results[1:]:
            v["metrics"].update(compare_scores(workload, first, v["_records"]))
    if workload.structured:  # the same requests' answers against the first column's
        first = results[0]["_records"]
        for v in results[1:]:
            v["metrics"].update(compare_texts(first, v["_records"]))
    for v in results:
        del v["_records"]

    head = title(workload, args)
    print(report.table(head, results))
    report.save(
        args,
        head,
        results,
        workload.name,
        workload_params=workload.params,
        num_requests=workload.num_requests,
    )
    return 1 if any(v["metrics"]["failed"] or v["metrics"]["not_sent"] for v in results) else 0


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m radixserve.benchmark.cli`` is the same as ``radixserve bench``."""
    p = argparse.ArgumentParser(prog="radixserve bench")
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
