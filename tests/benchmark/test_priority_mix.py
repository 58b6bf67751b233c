"""``radixserve bench --priority-mix``: a seeded share of the roots (each with its
follow-ups) goes at the urgent level; the table and the JSON report the two classes;
under ``--schedule-policy priority`` the urgent class is served first."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from radixserve.benchmark.cli import _retention
from radixserve.benchmark.workloads import TokenSource, mix_priorities, multi_turn
from radixserve.cli import main as radixserve_main
from tests.helpers.tiny_models import make_tiny_model


def _conversations(n: int):
    return multi_turn(TokenSource.random(500, seed=1), conversations=n, turns=3)


def test_a_share_of_the_roots_goes_urgent_with_its_follow_ups():
    w = _conversations(8)
    mix_priorities(w, 0.25, level=-2, retention=(50, 30.0), seed=3)
    urgent = [r for r in w.roots if r.priority == -2]
    assert len(urgent) == 2 and w.params["priority_mix"] == 0.25
    for root in w.roots:
        nodes = list(root.walk())
        assert len(nodes) == 3
        assert len({(n.priority, n.retention) for n in nodes}) == 1  # a conversation keeps one
        assert root.retention == ((50, 30.0) if root.priority == -2 else None)
    again = _conversations(8)
    mix_priorities(again, 0.25, level=-2, seed=3)
    assert [r.priority for r in again.roots] == [r.priority for r in w.roots]  # seeded


def test_both_classes_exist_when_both_are_asked_for():
    for share, expect in ((0.01, 1), (0.99, 3), (0.0, 0), (1.0, 4)):
        w = _conversations(4)
        mix_priorities(w, share)
        assert sum(r.priority == -1 for r in w.roots) == expect
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mix_priorities(_conversations(2), 1.5)


def test_retention_flag():
    assert _retention("40:12.5") == (40, 12.5) and _retention(None) is None
    for bad in ("40", "x:1", "1:y"):
        with pytest.raises(ValueError, match="LEVEL:SECONDS"):
            _retention(bad)


@pytest.fixture(scope="module")
def model_dir():
    folder = Path(tempfile.mkdtemp(prefix="rs-prio-"))
    make_tiny_model(folder, "llama", seed=5, max_position_embeddings=1024)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_priority_policy_serves_the_urgent_class_first(model_dir, tmp_path, capsys):
    """Twelve prompts sent at once, two slots: under the priority policy every urgent
    request has its first token no later than any normal one (the engine backend runs
    one step at a time, so this is an order, not a timing)."""
    out = tmp_path / "prio"
    argv = ["bench", "shared-prefix", "--model", str(model_dir), "--backend", "engine"]
    argv += ["--groups", "3", "--prompts", "4", "--system-len", "40", "--question-len", "8"]
    argv += ["--output-len", "4", "--priority-mix", "0.34", "--no-progress", "--no-plot"]
    argv += ["--output", str(out), "--compare", "schedule_policy=lpm,priority"]
    argv += ["--server-args", "--page-size 4 --num-pages 2048 --dtype float64 "
             "--max-running-requests 2"]  # fmt: skip
    assert radixserve_main(argv) == 0
    table = capsys.readouterr().out
    assert "TTFT urgent p99 ms" in table and "hit rate normal" in table
    doc = json.loads(out.with_suffix(".json").read_text())
    lpm, prio = doc["variants"]
    for v in (lpm, prio):
        m = v["metrics"]
        assert m["failed"] == 0 and m["requests_urgent"] == 4 and m["requests_normal"] == 8
        assert sum(r.get("priority") == -1 for r in v["requests"]) == 4
    rows = prio["requests"]
    first = {r["key"]: r["send_s"] + r["ttft_s"] for r in rows}
    urgent = [first[r["key"]] for r in rows if r.get("priority") == -1]
    normal = [first[r["key"]] for r in rows if r.get("priority") is None]
    assert max(urgent) <= min(normal)
