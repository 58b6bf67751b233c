"""``radixserve bench json-extract --compare jump_forward=true,false`` end to end through
the in-process Engine backend, on a tiny model.

Every answer ends with its grammar (not at max_tokens) and writes every key of
its schema in order, with and without jump-forward; with it, the forced keys
and separators come several tokens per step, so each request takes fewer steps
(chunks) and the server fewer model steps for the same requests; without it,
one token per chunk. The documents are shared: the cache serves them. The
validity rates are checked against the outputs themselves (a random model's
string values may hold raw control characters, which no strict JSON parser
takes), and on canned outputs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jsonschema
import pytest

from radixserve.benchmark.metrics import compare_texts, structured_summary
from radixserve.benchmark.runner import RequestRecord
from radixserve.benchmark.workloads import RECORDS, TokenSource, json_extract
from radixserve.cli import main as radixserve_main
from radixserve.results import Usage
from tests.helpers.tiny_models import make_tiny_model

ENGINE_FLAGS = "--page-size 4 --num-pages 4096 --dtype float64"


@pytest.fixture(scope="module")
def model_dir():
    folder = Path(tempfile.mkdtemp(prefix="rs-json-"))
    make_tiny_model(folder, "llama", seed=5, max_position_embeddings=1024)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_jump_forward_takes_fewer_steps_for_the_same_valid_objects(model_dir, tmp_path, capsys):
    out = tmp_path / "json"
    argv = ["bench", "json-extract", "--model", str(model_dir), "--backend", "engine"]
    argv += ["--documents", "2", "--questions", "4", "--document-len", "120"]
    argv += ["--question-len", "4", "--no-progress", "--no-plot", "--output", str(out)]
    argv += ["--server-args", ENGINE_FLAGS, "--compare", "jump_forward=true,false"]
    assert radixserve_main(argv) == 0

    table = capsys.readouterr().out
    assert "schema-valid" in table and "jump_forward=false / jump_forward=true" in table
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["workload"] == "json-extract" and doc["num_requests"] == 8
    on, off = doc["variants"]
    assert on["label"] == "jump_forward=true" and "--jump-forward" in on["server_args"]
    assert off["label"] == "jump_forward=false" and "--no-jump-forward" in off["server_args"]
    for v in (on, off):
        m = v["metrics"]
        assert m["failed"] == m["not_sent"] == 0, m["errors"]
        assert m["length_stops"] == 0
        # Every question of a document reuses it: hits reach the optimum.
        assert m["optimal_hit_rate"] > 0.3 and m["hit_vs_optimal"] >= 0.98
        valid = 0
        for r in v["requests"]:
            schema = RECORDS[int(r["key"].split("-q")[1]) % len(RECORDS)][1]
            text = r["output_text"]
            assert r["finish_reason"] == "stop" and text.startswith("{") and text.endswith("}")
            at = [text.index(f'"{k}": ') for k in schema["properties"]]
            assert at == sorted(at)  # every key, in the schema's order
            valid += _valid(text, schema)
        assert m["schema_valid_rate"] == valid / 8
    text = {r["key"]: r["output_text"] for r in on["requests"]}
    same = [r["output_text"] == text[r["key"]] for r in off["requests"]]
    assert "same_text" not in on["metrics"] and off["metrics"]["same_text"] == sum(same) / 8
    mon, moff = on["metrics"], off["metrics"]
    assert moff["tokens_per_chunk"] == 1.0 < mon["tokens_per_chunk"]
    assert mon["chunks_per_request"] < moff["chunks_per_request"]
    assert 0 < mon["steps"] < moff["steps"]


def _valid(text: str, schema: dict) -> bool:
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def test_validity_rates_on_canned_outputs():
    w = json_extract(TokenSource.random(100, 0), documents=1, questions=5, document_len=4)
    employee = {
        "employee_full_name": "Ada Lovelace",
        "department_name": "Research and Development",
        "years_of_experience": 12,
        "is_remote_employee": False,
        "office_location_city": "London",
        "performance_review_score": 5,
    }
    outputs = {
        "d0-q0": json.dumps(employee),  # valid
        "d0-q4": json.dumps({**employee, "years_of_experience": 51}),  # above its maximum
        "d0-q1": '{"product_display_name": "a\x02b"}',  # a raw control character
        "d0-q2": '{"event_title_description": "Py',  # cut at max_tokens
        "d0-q3": "not sent",
    }
    recs = []
    for order, (key, text) in enumerate(outputs.items()):
        rec = RequestRecord(key, order, [1], 256, 0.0, chunk_times=[0.1] * 4, output_text=text)
        rec.finish_reason = "length" if key == "d0-q2" else "stop"
        rec.usage = Usage(1, 8, 0) if key != "d0-q3" else None
        rec.error = "failed" if key == "d0-q3" else None
        recs.append(rec)
    m = structured_summary(w, recs)
    assert m["json_parse_rate"] == 2 / 4  # of the 4 finished; raw \x02 is not JSON
    assert m["schema_valid_rate"] == 1 / 4
    assert m["length_stops"] == 1
    assert m["chunks_per_request"] == 4.0 and m["tokens_per_chunk"] == 2.0
    # Another run's answers: the same text for one of the three both finished.
    again = [RequestRecord(r.key, r.order, [1], 256, 0.0, output_text=r.output_text) for r in recs]
    for r, a in zip(again, recs):
        r.usage, r.error = a.usage, a.error
    again[0].output_text = json.dumps({**employee, "is_remote_employee": True})
    again[1].error = "failed"
    assert compare_texts(recs, again) == {"same_text": 2 / 3}


def test_engine_backend_fails_a_request_the_engine_failed():
    """A request the scheduler ends with finish_reason "error" (a grammar rejected its
    token) is a failed request in the run, with the engine's message, not an empty answer."""
    import asyncio

    from radixserve.benchmark.backends import EngineBackend
    from radixserve.protocol import OutputItem

    backend = EngineBackend(engine=None)
    queue: asyncio.Queue = asyncio.Queue()
    backend._queues[("bench-1", 0)] = (None, queue)
    message = "the grammar rejected the sampled token 7"
    backend._dispatch(OutputItem("bench-1", 0, [], "error", 5, 0, 0, error=message))
    failure = queue.get_nowait()
    assert isinstance(failure, RuntimeError) and str(failure) == message
    assert not backend._queues
