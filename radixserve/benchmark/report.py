"""Outputs of a benchmark: a terminal table, a JSON file, a PNG plot.

The table puts variants side by side, with each later variant's value over the
first's (``x`` columns). The JSON holds every number, the exact configuration,
and one line per request; the PNG shows throughput, TTFT, and hit rate against
the offline optimum per variant.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixserve.benchmark.tree_picture import write_tree

PROGRAM_ROWS = [  # program runs only, first
    ("programs", "programs", "{:.0f}"),
    ("programs failed", "programs_failed", "{:.0f}"),
    ("programs/s", "program_throughput", "{:.3f}"),
    ("requests / program", "requests_per_program", "{:.1f}"),
]
ROWS = [  # (label, metrics key, format)
    ("requests", "requests", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("duration s", "duration_s", "{:.2f}"),
    ("requests/s", "request_throughput", "{:.3f}"),
    ("input tok/s", "input_tok_s", "{:.1f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("TTFT mean ms", "ttft_mean_ms", "{:.0f}"),
    ("TTFT median ms", "ttft_median_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("ITL mean ms", "itl_mean_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("TPOT mean ms", "tpot_mean_ms", "{:.1f}"),
    ("e2e mean ms", "e2e_mean_ms", "{:.0f}"),
    ("e2e p99 ms", "e2e_p99_ms", "{:.0f}"),
    ("prompt tokens", "prompt_tokens", "{:.0f}"),
    ("cached tokens", "cached_tokens", "{:.0f}"),
    ("computed tokens", "computed_tokens", "{:.0f}"),
    ("hit rate", "hit_rate", "{:.2%}"),
    ("optimal (page 1)", "optimal_hit_rate_page1", "{:.2%}"),
    ("optimal (server page)", "optimal_hit_rate", "{:.2%}"),
    ("hit / optimal", "hit_vs_optimal", "{:.3f}"),
]
HYBRID_ROWS = [  # hybrid models only: what their state-snapshot rule can reach
    ("snapshot rule (hybrid)", "snapshot_hit_rate", "{:.2%}"),
]
SCORE_ROWS = [  # scoring workloads only (a sanity check: see metrics.py)
    ("questions scored", "questions_scored", "{:.0f}"),
    ("accuracy (sum)", "accuracy", "{:.3f}"),
    ("accuracy (per token)", "accuracy_norm", "{:.3f}"),
    ("chance", "chance", "{:.3f}"),
    ("picks = first's", "picks_agree", "{:.3f}"),
    ("max |logprob - first's|", "max_logprob_diff", "{:.1e}"),
]

STRUCTURED_ROWS = [  # structured workloads only (json-extract)
    ("valid JSON", "json_parse_rate", "{:.2%}"),
    ("schema-valid", "schema_valid_rate", "{:.2%}"),
    ("cut at max_tokens", "length_stops", "{:.0f}"),
    ("model steps", "steps", "{:.0f}"),
    ("model steps / request", "steps_per_request", "{:.1f}"),
    ("chunks / request", "chunks_per_request", "{:.1f}"),
    ("tokens / chunk", "tokens_per_chunk", "{:.2f}"),
    ("text = first's", "same_text", "{:.2%}"),
]


SPEC_ROWS = [  # speculative decoding's counters (docs/speculative.md)
    ("model steps", "steps", "{:.0f}"),
    ("draft tokens", "spec_draft_tokens", "{:.0f}"),
    ("acceptance", "spec_acceptance", "{:.2%}"),
    ("tokens / verification", "spec_tokens_per_verification", "{:.2f}"),
]


PRIORITY_ROWS = [  # --priority-mix only: the two classes' first-token latency
    ("requests urgent", "requests_urgent", "{:d}"),
    ("TTFT urgent median ms", "ttft_urgent_median_ms", "{:.0f}"),
    ("TTFT urgent p99 ms", "ttft_urgent_p99_ms", "{:.0f}"),
    ("hit rate urgent", "hit_rate_urgent", "{:.2%}"),
    ("requests normal", "requests_normal", "{:d}"),
    ("TTFT normal median ms", "ttft_normal_median_ms", "{:.0f}"),
    ("TTFT normal p99 ms", "ttft_normal_p99_ms", "{:.0f}"),
    ("hit rate normal", "hit_rate_normal", "{:.2%}"),
]


TIER_ROWS = [  # servers with cache tiers (docs/cache-tiers.md)
    ("pages demoted", "pages_demoted", "{:.0f}"),
    ("pages promoted", "pages_promoted", "{:.0f}"),
    ("pages dropped", "pages_dropped", "{:.0f}"),
]


def group_rows(variants: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The agent workload's rows: TTFT and hit rate per turn (``Node.group``)."""
    groups: list[str] = []
    for v in variants:
        groups += [g for g in v["metrics"].get("groups", ()) if g not in groups]
    return [row for g in groups for row in (
        (f"TTFT mean ms, {g}", f"ttft_mean_ms[{g}]", "{:.0f}"),
        (f"hit rate, {g}", f"hit_rate[{g}]", "{:.2%}"),
    )]  # fmt: skip


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(
    title: str, variants: list[dict[str, Any]], extra: Sequence[tuple[str, str, str]] = ()
) -> str:
    """Rows = metrics (``extra``: a workload's own, last), columns = variants, then
    value / first variant's value."""
    labels = [v["label"] for v in variants]
    base = labels[0]
    head = ["metric", *labels] + [f"{lab} / {base}" for lab in labels[1:]]
    lines = []
    rows = list(ROWS)
    if any("programs" in v["metrics"] for v in variants):
        rows = PROGRAM_ROWS + rows
    if any("accuracy" in v["metrics"] for v in variants):
        rows += SCORE_ROWS
    if any("schema_valid_rate" in v["metrics"] for v in variants):
        rows += STRUCTURED_ROWS
    if any(v["metrics"].get("hybrid") for v in variants):
        rows += HYBRID_ROWS
    if any(v["metrics"].get("spec_draft_tokens") for v in variants):
        rows += SPEC_ROWS
    if any("ttft_urgent_median_ms" in v["metrics"] for v in variants):
        rows += PRIORITY_ROWS
    rows += group_rows(variants)
    if any("pages_demoted" in v["metrics"] for v in variants):
        rows += TIER_ROWS
    rows += list(extra)
    for name, key, fmt in rows:
        vals = [v["metrics"].get(key) for v in variants]
        row = [name] + [_fmt(x, fmt) for x in vals]
        for x in vals[1:]:
            ok = isinstance(x, int | float) and isinstance(vals[0], int | float) and vals[0]
            row.append(f"{x / vals[0]:.2f}x" if ok else "-")  # type: ignore[operator]
        lines.append(row)
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]

    def render(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        )

    rule = "-" * len(render(head))
    return "\n".join([title, rule, render(head), rule, *map(render, lines), rule])


def request_rows(result_records: list[Any], texts: bool = False) -> list[dict[str, Any]]:
    """One compact line per request for the JSON (lengths, not the token ids; with
    ``texts``, the output text too)."""
    rows = []
    for r in result_records:
        u = r.usage
        rows.append(
            {
                "key": r.key,
                "order": r.order,
                "prompt_len": len(r.prompt_ids),
                "output_len": len(r.output_ids),
                "send_s": r.send_time,
                "ttft_s": r.chunk_times[0] - r.send_time if r.chunk_times else None,
                "e2e_s": r.end_time - r.send_time,
                "prompt_tokens": u.prompt_tokens if u else None,
                "completion_tokens": u.completion_tokens if u else None,
                "cached_tokens": u.cached_tokens if u and r.cached_known else None,
                "error": r.error,
                "finish_reason": r.finish_reason,
            }
        )
        if texts:
            rows[-1]["output_text"] = r.output_text
        if r.priority:
            rows[-1]["priority"] = r.priority
        if r.score_start is not None:
            rows[-1].update(
                score_start=r.score_start,
                logprob_start_len=r.logprob_start_len,
                choice_logprob=r.choice_logprob,
            )
    return rows


def save(args: Any, head: str, variants: list[dict[str, Any]], name: str, **fields: Any) -> None:
    """Write a run's JSON (and PNG unless ``--no-plot``) to ``--output`` or
    ``bench/results/NAME-<time>``: the title, ``fields`` (what the workload was), the
    configuration and the variants; say where."""
    prefix = Path(args.output or f"bench/results/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    doc = {
        "title": head,
        "workload": name,
        **fields,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "argv": sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "variants": variants,
    }
    json_path, png_path = Path(f"{prefix}.json"), Path(f"{prefix}.png")
    write_json(json_path, doc)
    written = [str(json_path)]
    if not args.no_plot:
        write_png(png_path, head, variants)
        written.append(str(png_path))
        # The cache's tree at the end of each run, as the dashboard draws it.
        for v in variants:
            if v.get("tree", {}).get("nodes"):
                one = len(variants) == 1
                svg = Path(
                    f"{prefix}-tree.svg" if one else f"{prefix}-tree-{_slug(v['label'])}.svg"
                )
                write_tree(svg, v["tree"], f"{head} · {v['label']}: the cache's largest prefixes")
                written.append(str(svg))
    print("wrote " + ", ".join(written))


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def write_png(path: Path, title: str, variants: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    labels = [v["label"] for v in variants]
    m = [v["metrics"] for v in variants]
    x = range(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))

    ax = axes[0]
    ax.bar(x, [d["output_tok_s"] for d in m], color="tab:blue")
    ax.set_title("output throughput (tokens/s)")

    ax = axes[1]
    w = 0.27
    for i, (k, name) in enumerate(
        [("ttft_mean_ms", "mean"), ("ttft_median_ms", "median"), ("ttft_p99_ms", "p99")]
    ):
        ax.bar([j + (i - 1) * w for j in x], [d[k] or 0 for d in m], w, label=name)
    ax.set_title("time to first token (ms)")
    ax.legend()

    ax = axes[2]
    for i, (k, name) in enumerate(
        [
            ("hit_rate", "achieved"),
            ("optimal_hit_rate", "optimal (server page)"),
            ("optimal_hit_rate_page1", "optimal (page 1)"),
        ]
    ):
        ax.bar([j + (i - 1) * w for j in x], [d[k] or 0 for d in m], w, label=name)
    ax.set_ylim(0, 1.05)
    ax.set_title("prefix cache hit rate")
    ax.legend(loc="lower right")

    for ax in axes:
        ax.set_xticks(list(x), labels)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
