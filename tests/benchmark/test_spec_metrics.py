"""The benchmark's speculative decoding rows: from the scheduler's counters to the table."""

from __future__ import annotations

from radixserve.benchmark import report
from radixserve.benchmark.metrics import step_summary, summarize
from radixserve.benchmark.runner import RequestRecord, RunResult
from radixserve.results import Usage


def test_acceptance_and_tokens_per_verification_come_from_the_counters_delta():
    before = {
        "steps": 10,
        "spec_draft_tokens": 40,
        "spec_accepted_tokens": 10,
        "spec_verifications": 12,
    }
    after = {
        "steps": 30,
        "spec_draft_tokens": 140,
        "spec_accepted_tokens": 85,
        "spec_verifications": 37,
    }
    m = step_summary(before, after, 4)
    assert m["steps"] == 20 and m["steps_per_request"] == 5
    assert m["spec_draft_tokens"] == 100
    assert m["spec_acceptance"] == 0.75
    assert m["spec_tokens_per_verification"] == 1 + 75 / 25
    zero = dict.fromkeys(("spec_draft_tokens", "spec_accepted_tokens", "spec_verifications"), 0)
    off = step_summary({"steps": 1, **zero}, {"steps": 5, **zero}, 2)
    assert off["spec_acceptance"] is None and off["spec_tokens_per_verification"] is None
    variants = [
        {"label": "off", "metrics": {"requests": 4, **off}},
        {"label": "radix", "metrics": {"requests": 4, **m}},
    ]
    text = report.table("copy", variants)
    assert "acceptance" in text and "75.00%" in text and "4.00" in text
    assert "acceptance" not in report.table("copy", variants[:1])  # no drafts: no rows


def test_tpot_is_per_token_however_tokens_are_chunked():
    """Two requests of 9 tokens over 0.8 s after their first chunk: one token per
    chunk, or (accepted drafts) three per chunk. ITL differs, TPOT does not."""
    one = RequestRecord("a", 0, [1, 2], 9, 0.0, chunk_times=[0.1 * i for i in range(1, 10)])
    three = RequestRecord("b", 1, [1, 2], 9, 0.0, chunk_times=[0.1, 0.5, 0.9])
    for r in (one, three):
        r.output_ids = list(range(9))
        r.usage = Usage(prompt_tokens=2, completion_tokens=9)
        r.end_time = 1.0
    m = summarize(RunResult([one, three], 1.0, 0), page_size=1)
    assert abs(m["tpot_mean_ms"] - 100.0) < 1e-9
    assert abs(m["itl_mean_ms"] - (8 * 100 + 2 * 400) / 10) < 1e-9
