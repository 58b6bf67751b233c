"""One run's numbers: throughput, latency percentiles, hit rate against the optimum.

Latencies are in milliseconds. TTFT: send to the first chunk with output.
ITL (inter-token latency): gaps between consecutive output chunks of one
request (one token each on radixserve, but for a grammar's forced tokens and a
speculative verification's accepted drafts; servers that batch tokens into a
chunk show larger gaps). TPOT (time per output token): per request, first chunk
to last over the output tokens after the first, averaged over requests: the
per-token latency whatever the chunking. Hit rate: sum of the server's ``cached_tokens`` over sum of
its ``prompt_tokens``, over the requests that finished. Computed tokens: prompt
tokens the server did not take from its cache (it ran the model over them).

Scoring workloads add, per run: how many questions had every choice scored,
the accuracy of picking the choice with the highest logprob sum (``accuracy``)
or mean logprob per token (``accuracy_norm``), against chance (1 / choices).
Over a random or tiny model these are a sanity check, not a measurement.
``compare_scores`` says whether two runs of the same requests picked the same
choices, and how far apart their logprob sums are.

Structured workloads add the share of finished requests whose output parses as
JSON (``json_parse_rate``) and validates against its schema
(``schema_valid_rate``, with ``jsonschema``), the requests cut at
``max_tokens`` (``length_stops``), and what jump-forward changes: output chunks
per request (one per model step that gave the request tokens, on radixserve's
backends) and output tokens per chunk. ``step_summary`` adds the server's own
count of model steps over the run, when it keeps one; ``compare_texts``, the
share of the same requests whose answers two runs wrote alike (jump-forward may
change them: its forced text comes canonically tokenized, docs/structured.md).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from radixserve.benchmark.optimal import optimal_hits, snapshot_hits
from radixserve.benchmark.runner import RequestRecord, RunResult, pairs
from radixserve.benchmark.workloads import Workload


def _stats(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_mean_ms": None, f"{prefix}_median_ms": None, f"{prefix}_p99_ms": None}
    a = np.asarray(values) * 1e3
    return {
        f"{prefix}_mean_ms": float(a.mean()),
        f"{prefix}_median_ms": float(np.median(a)),
        f"{prefix}_p99_ms": float(np.percentile(a, 99)),
    }


def summarize(
    result: RunResult, page_size: int, workload: Workload | None = None
) -> dict[str, Any]:
    """Every number of one run (see the module docstring for definitions); with a
    scoring ``workload``, its scoring numbers too."""
    recs = result.records
    ok = [r for r in recs if r.ok]
    duration = result.duration
    prompt_tokens = sum(r.usage.prompt_tokens for r in ok)  # type: ignore[union-attr]
    completion_tokens = sum(r.usage.completion_tokens for r in ok)  # type: ignore[union-attr]
    cached_tokens = sum(r.usage.cached_tokens for r in ok)  # type: ignore[union-attr]
    ttft = [r.chunk_times[0] - r.send_time for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [
        (r.chunk_times[-1] - r.chunk_times[0]) / (len(r.output_ids) - 1)
        for r in ok
        if r.chunk_times and len(r.output_ids) > 1
    ]
    e2e = [r.end_time - r.send_time for r in ok]

    # The optimum replays every request sent (a failed one may still have filled the
    # cache), and is summed over the finished ones, like the achieved rate.
    sent = pairs(recs)
    starts = [r.logprob_start_len for r in recs]
    ok_idx = [i for i, r in enumerate(recs) if r.ok]
    sent_prompt = sum(len(recs[i].prompt_ids) for i in ok_idx)

    def optimum(ps: int, rule=optimal_hits) -> float | None:
        hits = rule(sent, ps, starts)
        return sum(hits[i] for i in ok_idx) / sent_prompt if sent_prompt else None

    hit_known = all(r.cached_known for r in ok)
    hit_rate = cached_tokens / prompt_tokens if hit_known and prompt_tokens else None
    opt1, opt_page = optimum(1), optimum(page_size)
    extra = score_summary(workload, recs) if workload is not None and workload.answers else {}
    levels = sorted({r.priority for r in recs})
    if len(levels) > 1:  # --priority-mix: TTFT per level (the urgent class first)
        for level in levels:
            at = [
                r.chunk_times[0] - r.send_time for r in ok if r.priority == level and r.chunk_times
            ]
            name = (
                "urgent" if level == levels[0] else "normal" if level == levels[-1] else str(level)
            )
            extra.update(_stats(at, f"ttft_{name}"))
            extra[f"requests_{name}"] = sum(r.priority == level for r in ok)
            mine = [r for r in ok if r.priority == level]
            prompt = sum(r.usage.prompt_tokens for r in mine)  # type: ignore[union-attr]
            cached = sum(r.usage.cached_tokens for r in mine)  # type: ignore[union-attr]
            extra[f"hit_rate_{name}"] = cached / prompt if hit_known and prompt else None
    groups = sorted({r.group for r in recs if r.group})
    if groups:  # the agent workload: TTFT and hit rate per turn (and the one-offs)
        extra["groups"] = groups
        for g in groups:
            mine = [r for r in ok if r.group == g]
            extra[f"ttft_mean_ms[{g}]"] = _stats(
                [r.chunk_times[0] - r.send_time for r in mine if r.chunk_times], "ttft"
            )["ttft_mean_ms"]
            prompt = sum(r.usage.prompt_tokens for r in mine)  # type: ignore[union-attr]
            cached = sum(r.usage.cached_tokens for r in mine)  # type: ignore[union-attr]
            extra[f"hit_rate[{g}]"] = cached / prompt if hit_known and prompt else None
    if workload is not None and workload.structured:
        extra.update(structured_summary(workload, recs))
    return {
        "requests": len(ok),
        "failed": len(recs) - len(ok),
        "not_sent": result.not_sent,
        "errors": sorted({r.error for r in recs if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_tok_s": prompt_tokens / duration if duration else 0.0,
        "output_tok_s": completion_tokens / duration if duration else 0.0,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens if hit_known else None,
        "computed_tokens": prompt_tokens - cached_tokens if hit_known else None,
        "sent_prompt_tokens": sent_prompt,
        "received_output_tokens": sum(len(r.output_ids) for r in ok),
        "expected_output_tokens": sum(r.max_tokens for r in ok),
        # Requests whose usage disagrees with what was sent / received: should be 0.
        "prompt_count_mismatches": sum(r.usage.prompt_tokens != len(r.prompt_ids) for r in ok),  # type: ignore[union-attr]
        "output_count_mismatches": sum(
            r.usage.completion_tokens != len(r.output_ids)  # type: ignore[union-attr]
            for r in ok
        ),
        **_stats(ttft, "ttft"),
        "itl_mean_ms": _stats(itl, "itl")["itl_mean_ms"],
        "itl_p99_ms": _stats(itl, "itl")["itl_p99_ms"],
        "tpot_mean_ms": _stats(tpot, "tpot")["tpot_mean_ms"],
        **_stats(e2e, "e2e"),
        "hit_rate": hit_rate,
        "page_size": page_size,
        "optimal_hit_rate_page1": opt1,
        "optimal_hit_rate": opt_page,
        # What a hybrid model's snapshot rule reaches with requests one at a time.
        "snapshot_hit_rate": optimum(page_size, snapshot_hits),
        "hit_vs_optimal": hit_rate / opt_page if hit_rate is not None and opt_page else None,
        **extra,
    }


def _picks(workload: Workload, recs: list[RequestRecord]) -> dict[str, tuple[int, int]]:
    """Question -> (the choice of highest logprob sum, of highest mean logprob per
    choice token), over questions whose every choice was scored."""
    n_choices = int(workload.params.get("choices") or 0)
    by_q: dict[str, dict[int, tuple[float, int]]] = {}
    for r, node in _scored(workload, recs):
        if r.ok and r.choice_logprob is not None:
            n = len(r.prompt_ids) - node.score.start  # type: ignore[union-attr]
            by_q.setdefault(node.score.question, {})[node.score.choice] = (r.choice_logprob, n)  # type: ignore[union-attr]
    out = {}
    for q, scores in by_q.items():
        if len(scores) == n_choices:
            total = max(scores, key=lambda c: scores[c][0])
            norm = max(scores, key=lambda c: scores[c][0] / scores[c][1])
            out[q] = (total, norm)
    return out


def _scored(workload: Workload, recs: list[RequestRecord]) -> list[tuple[RequestRecord, Any]]:
    nodes = {n.key: n for root in workload.roots for n in root.walk() if n.score is not None}
    return [(r, nodes[r.key]) for r in recs if r.key in nodes]


def score_summary(workload: Workload, recs: list[RequestRecord]) -> dict[str, Any]:
    picks = _picks(workload, recs)
    n = len(picks)
    right = [workload.answers[q] for q in picks]
    choices = int(workload.params.get("choices") or 0)
    return {
        "questions": len(workload.answers),
        "questions_scored": n,
        "accuracy": sum(p[0] == a for p, a in zip(picks.values(), right)) / n if n else None,
        "accuracy_norm": sum(p[1] == a for p, a in zip(picks.values(), right)) / n if n else None,
        "chance": 1 / choices if choices else None,
    }


def compare_scores(
    workload: Workload, base: list[RequestRecord], other: list[RequestRecord]
) -> dict[str, Any]:
    """Two runs of the same scored requests: the share of questions where both
    picked the same choice (by sum), and the largest |difference| of a choice's
    logprob sum."""
    pa, pb = _picks(workload, base), _picks(workload, other)
    both = [q for q in pa if q in pb]
    a = {r.key: r.choice_logprob for r in base}
    diffs = [
        abs(a[r.key] - r.choice_logprob)  # type: ignore[operator]
        for r in other
        if r.choice_logprob is not None and a.get(r.key) is not None
    ]
    return {
        "picks_agree": sum(pa[q][0] == pb[q][0] for q in both) / len(both) if both else None,
        "max_logprob_diff": max(diffs) if diffs else None,
    }


def structured_summary(workload: Workload, recs: list[RequestRecord]) -> dict[str, Any]:
    """Validity and chunking of the finished structured requests (module docstring)."""
    import jsonschema

    nodes = {n.key: n for root in workload.roots for n in root.walk() if n.structured is not None}
    done = [r for r in recs if r.ok and r.key in nodes]
    validators: dict[str, Any] = {}
    parsed = valid = 0
    for r in done:
        try:
            obj = json.loads(r.output_text)
        except ValueError:
            continue
        parsed += 1
        spec = nodes[r.key].structured.spec  # type: ignore[union-attr]
        if spec not in validators:
            schema = json.loads(spec)
            validators[spec] = jsonschema.validators.validator_for(schema)(schema)
        valid += validators[spec].is_valid(obj)
    chunks = sum(len(r.chunk_times) for r in done)
    tokens = sum(r.usage.completion_tokens for r in done)  # type: ignore[union-attr]
    n = len(done)
    return {
        "json_parse_rate": parsed / n if n else None,
        "schema_valid_rate": valid / n if n else None,
        "length_stops": sum(r.finish_reason == "length" for r in done),
        "chunks_per_request": chunks / n if n else None,
        "tokens_per_chunk": tokens / chunks if chunks else None,
    }


def step_summary(
    before: dict[str, Any] | None, after: dict[str, Any] | None, requests: int
) -> dict[str, Any]:
    """The server's model steps over the run (the delta of its ``steps`` counter),
    and per finished request; None when the backend does not count them. With the
    speculative decoding counters: drafts verified, the share accepted, and tokens
    per verification."""
    if not before or not after or "steps" not in before or "steps" not in after:
        return {"steps": None, "steps_per_request": None}
    steps = int(after["steps"]) - int(before["steps"])
    out: dict[str, Any] = {
        "steps": steps,
        "steps_per_request": steps / requests if requests else None,
    }
    for key in ("pages_demoted", "pages_promoted", "pages_dropped"):  # cache tiers
        if key in before and key in after:
            out[key] = int(after[key]) - int(before[key])
    if "spec_verifications" in before and "spec_verifications" in after:
        # Speculative decoding (docs/speculative.md): drafts verified and accepted.
        drafted, accepted, verifications = (
            int(after[k]) - int(before[k])
            for k in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verifications")
        )
        out["spec_draft_tokens"] = drafted
        out["spec_acceptance"] = accepted / drafted if drafted else None
        out["spec_tokens_per_verification"] = (
            1 + accepted / verifications if verifications else None
        )
    return out


def compare_texts(base: list[RequestRecord], other: list[RequestRecord]) -> dict[str, Any]:
    """Of the requests both runs finished, the share whose output text is the same."""
    a = {r.key: r.output_text for r in base if r.ok}
    both = [r for r in other if r.ok and r.key in a]
    same = sum(r.output_text == a[r.key] for r in both)
    return {"same_text": same / len(both) if both else None}
