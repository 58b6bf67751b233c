"""One run's numbers: throughput, latency percentiles, hit rate against the optimum.

Latencies are in milliseconds. TTFT: send to the first chunk with output.
ITL (inter-token latency): gaps between consecutive output chunks of one
request (one token each on radixserve; servers that batch tokens into a chunk
show larger gaps). Hit rate: sum of the server's ``cached_tokens`` over sum of
its ``prompt_tokens``, over the requests that finished.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.benchmark.optimal import optimal_hits
from radixserve.benchmark.runner import RunResult, pairs


def _stats(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_mean_ms": None, f"{prefix}_median_ms": None, f"{prefix}_p99_ms": None}
    a = np.asarray(values) * 1e3
    return {
        f"{prefix}_mean_ms": float(a.mean()),
        f"{prefix}_median_ms": float(np.median(a)),
        f"{prefix}_p99_ms": float(np.percentile(a, 99)),
    }


def summarize(result: RunResult, page_size: int) -> dict[str, Any]:
    """Every number of one run (see the module docstring for definitions)."""
    recs = result.records
    ok = [r for r in recs if r.ok]
    duration = result.duration
    prompt_tokens = sum(r.usage.prompt_tokens for r in ok)  # type: ignore[union-attr]
    completion_tokens = sum(r.usage.completion_tokens for r in ok)  # type: ignore[union-attr]
    cached_tokens = sum(r.usage.cached_tokens for r in ok)  # type: ignore[union-attr]
    ttft = [r.chunk_times[0] - r.send_time for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.end_time - r.send_time for r in ok]

    # The optimum replays every request sent (a failed one may still have filled the
    # cache), and is summed over the finished ones, like the achieved rate.
    sent = pairs(recs)
    ok_idx = [i for i, r in enumerate(recs) if r.ok]
    sent_prompt = sum(len(recs[i].prompt_ids) for i in ok_idx)

    def optimum(ps: int) -> float | None:
        hits = optimal_hits(sent, ps)
        return sum(hits[i] for i in ok_idx) / sent_prompt if sent_prompt else None

    hit_known = all(r.cached_known for r in ok)
    hit_rate = cached_tokens / prompt_tokens if hit_known and prompt_tokens else None
    opt1, opt_page = optimum(1), optimum(page_size)
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
        **_stats(e2e, "e2e"),
        "hit_rate": hit_rate,
        "page_size": page_size,
        "optimal_hit_rate_page1": opt1,
        "optimal_hit_rate": opt_page,
        "hit_vs_optimal": hit_rate / opt_page if hit_rate is not None and opt_page else None,
    }
