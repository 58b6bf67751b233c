"""``radixserve bench multimodal``: questions about images behind a shared system prompt,
for a vision-language model (docs/multimodal.md).

The workload: ``--images`` K random images (``--image-size WxH`` pixels, each with its
own seed), ``--questions`` Q questions about each, every request a chat of the one
system prompt (``--system-len`` words) and a user turn of one image and one question
(``--question-len`` words), ``--output-len`` tokens answered (``ignore_eos``). The
requests go in Q rounds, each round one question about every image (the images
interleaved, sent at once); a round starts when the one before has finished. Round 0
meets every image cold; the later rounds repeat an image with a new question.

Each chat is sent as messages with the image as a data URL (the client library's
``{type: image}`` part). The bench expands the same chat locally with the model's own
tokenizer and image processor (``InputProcessor.to_request``) and keys it as the
scheduler does (``scheduler.images.keyed_prompt``), so the offline optimum replays
exactly what the radix tree sees: the same image hits, another image parts at its
first token.

Besides the usual table (throughput, TTFT, hit rate against the offline optimum), it
reports the TTFT of round 0 (cold images) and of the later rounds (a repeated image
with a new question) and their ratio, and the vision encoder's runs and cache hits
(the server's ``encoder_runs``, ``encoder_cache_hits``).

Targets: a radixserve server (``--endpoint``, one launched, or one per ``--compare``
variant, e.g. ``--compare cache=radix,none``).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.benchmark import report
from radixserve.benchmark.backends import RadixserveBackend
from radixserve.benchmark.metrics import step_summary, summarize
from radixserve.benchmark.runner import RequestRecord, RunResult
from radixserve.results import Usage
from radixserve.sampling_params import SamplingParams

DEFAULTS = {"images": 4, "questions": 4, "system_len": 200, "question_len": 16,
            "output_len": 16, "image_size": "448x336"}  # fmt: skip
# The flags of the generic workloads a multimodal run takes.
MULTIMODAL_FLAGS = {"images", "questions", "system-len", "question-len", "output-len", "image-size"}
_WORDS = [
    "image",
    "picture",
    "colour",
    "shape",
    "light",
    "shadow",
    "corner",
    "edge",
    "texture",
    "pattern",
    "object",
    "scene",
    "left",
    "right",
    "top",
    "bottom",
    "centre",
    "bright",
    "dark",
    "red",
    "green",
    "blue",
    "small",
    "large",
    "count",
    "describe",
    "what",
    "where",
    "which",
    "how",
    "many",
    "near",
    "far",
    "above",
    "below",
    "between",
    "behind",
    "front",
    "detail",
]

ROWS = [  # what this workload adds to the table
    ("images", "images", "{:.0f}"),
    ("TTFT cold image ms", "ttft_cold_image_ms", "{:.0f}"),
    ("TTFT repeat image ms", "ttft_repeat_image_ms", "{:.0f}"),
    ("repeat / cold TTFT", "ttft_repeat_vs_cold", "{:.3f}"),
    ("encoder runs", "encoder_runs", "{:.0f}"),
    ("encoder cache hits", "encoder_cache_hits", "{:.0f}"),
]


@dataclass
class Request:
    key: str
    round: int
    messages: list[dict[str, Any]]
    keyed_ids: list[int]  # the prompt as the prefix cache keys it


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(_WORDS, n))


def image_png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB image of ``size`` (width, height), PNG-encoded."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def parse_size(text: str) -> tuple[int, int]:
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise SystemExit(f"radixserve bench multimodal: --image-size wants WxH, got {text!r}")
    return int(w), int(h)


def build(inputs: Any, p: dict[str, Any], seed: int) -> list[Request]:
    """The requests in send order (round by round, every image in each round).
    ``inputs``: the model's ``InputProcessor`` with its vision inputs."""
    from radixserve.scheduler.images import keyed_prompt

    rng = np.random.default_rng(seed)
    size = parse_size(p["image_size"])
    system = words(rng, p["system_len"])
    images = [image_png(seed * 1000 + i, size) for i in range(p["images"])]
    out = []
    for r in range(p["questions"]):
        for i, image in enumerate(images):
            question = words(rng, p["question_len"]) + "?"
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": question}]},
            ]  # fmt: skip
            ids, decoded = inputs.to_request(messages=messages, trusted=True)
            keyed = keyed_prompt(np.asarray(ids, dtype=np.int32), decoded).tolist()
            out.append(Request(f"image{i}-q{r}", r, messages, keyed))
    return out


async def _one(
    client: Any, req: Request, order: int, t0: float, output_len: int, timeout: float
) -> RequestRecord:
    rec = RequestRecord(req.key, order, req.keyed_ids, output_len, time.perf_counter() - t0)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        async for chunk in client.generate_stream(
            messages=req.messages, sampling_params=sp, timeout=timeout
        ):
            if chunk.token_ids:
                rec.chunk_times.append(time.perf_counter() - t0)
                rec.output_ids += list(chunk.token_ids)
            if chunk.usage:
                rec.usage = Usage(**chunk.usage)
            if chunk.finish_reason is not None:
                rec.finish_reason = chunk.finish_reason
    except Exception as e:  # a failed request is counted, the run goes on
        rec.error = str(e)[:200]
    rec.end_time = time.perf_counter() - t0
    return rec


async def run_rounds(
    client: Any, requests: Sequence[Request], output_len: int, timeout: float
) -> RunResult:
    t0 = time.perf_counter()
    records: list[RequestRecord] = []
    for r in sorted({q.round for q in requests}):
        batch = [q for q in requests if q.round == r]
        base = len(records)
        records += await asyncio.gather(
            *(_one(client, q, base + k, t0, output_len, timeout) for k, q in enumerate(batch))
        )
    return RunResult(records, time.perf_counter() - t0, 0)


def image_summary(
    requests: Sequence[Request], result: RunResult, before: dict, after: dict
) -> dict[str, Any]:
    """TTFT of cold and repeated images, and the encoder's counters over the run."""
    rounds = {q.key: q.round for q in requests}

    def mean_ttft(cold: bool) -> float | None:
        t = [r.chunk_times[0] - r.send_time for r in result.records
             if r.ok and r.chunk_times and (rounds[r.key] == 0) == cold]  # fmt: skip
        return 1000 * float(np.mean(t)) if t else None

    cold, repeat = mean_ttft(True), mean_ttft(False)
    return {
        "images": len({q.key.split("-")[0] for q in requests}),
        "ttft_cold_image_ms": cold,
        "ttft_repeat_image_ms": repeat,
        "ttft_repeat_vs_cold": repeat / cold if cold and repeat is not None else None,
        "encoder_runs": after.get("encoder_runs", 0) - before.get("encoder_runs", 0),
        "encoder_cache_hits": after.get("encoder_cache_hits", 0)
        - before.get("encoder_cache_hits", 0),
    }


async def run_variant(
    args: argparse.Namespace, p: dict[str, Any], requests: list[Request], endpoint: str, label: str
) -> dict[str, Any]:
    backend = RadixserveBackend(endpoint, args.timeout)
    try:
        info = await backend.info()
        for _ in range(args.warmup):  # text only: the images stay cold
            await backend.client.generate(prompt="Warm up.", max_tokens=4)
        flushed = await backend.reset_cache()
        before = await backend.stats() or {}
        result = await run_rounds(backend.client, requests, p["output_len"], args.timeout)
        after = await backend.stats() or {}
    finally:
        await backend.close()
    metrics = summarize(result, info.page_size)
    metrics.update(step_summary(before, after, metrics["requests"]))
    metrics.update(image_summary(requests, result, before, after))
    return {
        "label": label,
        "backend": backend.name,
        "model": info.model,
        "page_size": info.page_size,
        "cache_flushed_before_run": flushed,
        "stats_before": before,
        "stats_after": after,
        "metrics": metrics,
        "requests": report.request_rows(result.records),
    }


def params(args: argparse.Namespace, workload_flags: Sequence[str]) -> dict[str, Any]:
    if args.backend != "radixserve":
        raise SystemExit(
            "radixserve bench multimodal: radixserve servers only (--backend radixserve)"
        )
    for name in workload_flags:
        if name not in MULTIMODAL_FLAGS and getattr(args, name.replace("-", "_")) is not None:
            raise SystemExit(f"radixserve bench: --{name} does not apply to multimodal")
    p = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS.items()}
    if min(p["images"], p["questions"], p["system_len"], p["question_len"], p["output_len"]) < 1:
        raise SystemExit("radixserve bench multimodal: counts and lengths must be >= 1")
    parse_size(p["image_size"])
    return p


def title(p: dict[str, Any]) -> str:
    return (
        f"multimodal: {p['images']} images ({p['image_size']}) x {p['questions']} questions "
        f"in rounds, system prompt {p['system_len']} words, questions {p['question_len']}, "
        f"{p['output_len']} output tokens"
    )


def main(args: argparse.Namespace, workload_flags: Sequence[str]) -> int:
    """``radixserve bench multimodal``: every variant, then the table, JSON and PNG."""
    from radixserve.benchmark.server import LaunchedServer
    from radixserve.benchmark.targets import variants
    from radixserve.config import EngineConfig, tokenizer_config
    from radixserve.models.source import resolve_model
    from radixserve.models.tokenizer import load_tokenizer
    from radixserve.tokenizer.images import load_vision_inputs
    from radixserve.tokenizer.inputs import InputProcessor

    p = params(args, workload_flags)
    folder = resolve_model(args.model).folder
    tokenizer = load_tokenizer(args.model)
    vision = load_vision_inputs(folder, tokenizer)
    if vision is None:
        raise SystemExit(
            f"radixserve bench multimodal: {args.model} is not a vision-language model"
        )
    inputs = InputProcessor(
        tokenizer, None, tokenizer_config(EngineConfig(model=args.model)), None, vision
    )
    requests = build(inputs, p, args.seed)
    results = []
    for label, launch_args in variants(args):
        if launch_args is None:
            results.append(asyncio.run(run_variant(args, p, requests, args.endpoint, label)))
            continue
        print(f"radixserve bench: launching {label}: {' '.join(launch_args)}", file=sys.stderr)
        with LaunchedServer(launch_args) as server:
            v = asyncio.run(run_variant(args, p, requests, server.endpoint, label))
        v["server_args"], v["server_summary"] = launch_args, server.summary
        results.append(v)
    head = title(p)
    print(report.table(head, results, ROWS))
    report.save(args, head, results, "multimodal", workload_params=p, num_requests=len(requests))
    return 1 if any(v["metrics"]["failed"] for v in results) else 0
