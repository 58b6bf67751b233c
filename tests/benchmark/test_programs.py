"""``radixserve bench program`` end to end on a tiny chat model: with
``--compare cache=radix,none`` through the in-process Engine backend, and against
a launched server over ZeroMQ.

Every program finishes; every request the programs sent is recorded with the
server's usage; with the radix cache the forks' shared contexts come from the
cache, at most what the offline optimum over the same requests allows; without
a cache nothing does.
"""

from __future__ import annotations

import json

import pytest

from radixserve.cli import main as radixserve_main
from tests.helpers.server import Server
from tests.helpers.tiny_models import make_tiny_model

ENGINE_FLAGS = "--page-size 4 --num-pages 4096 --dtype float64"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny-programs"), "llama", seed=7, max_position_embeddings=1024
    )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


def bench(model_dir, out, *target: str) -> list[str]:
    argv = ["bench", "program", "--program", "all", "--programs", "2", "--output-len", "6"]
    argv += ["--model", str(model_dir), "--no-progress", "--no-plot", "--output", str(out)]
    return argv + list(target)


def check_run(m: dict, rows: list[dict]) -> None:
    """The numbers of one run add up, over requests of all four programs."""
    assert m["programs"] == 8 and m["programs_failed"] == 0, m["program_errors"]
    assert m["failed"] == 0, m["errors"]
    assert m["requests"] == len(rows) == round(m["requests_per_program"] * 8)
    assert sorted(r["order"] for r in rows) == list(range(len(rows)))
    assert m["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert m["prompt_tokens"] == m["sent_prompt_tokens"]
    assert m["cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    assert m["prompt_count_mismatches"] == m["output_count_mismatches"] == 0
    assert {r["key"].split("-")[0] for r in rows} == {"select", "tot", "sot", "bsm"}
    assert 0 < m["optimal_hit_rate"] <= m["optimal_hit_rate_page1"] < 1
    # Prefill-only requests (a fork's context, select's choices) were sent.
    assert any(r["completion_tokens"] == 0 for r in rows)


def test_programs_hit_the_cache_within_the_optimum(model_dir, tmp_path, capsys):
    out = tmp_path / "programs"
    argv = bench(model_dir, out, "--backend", "engine", "--server-args", ENGINE_FLAGS)
    assert radixserve_main([*argv, "--compare", "cache=radix,none"]) == 0

    table = capsys.readouterr().out
    assert "programs/s" in table and "hit / optimal" in table and "cache=none" in table
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["workload"] == "program" and doc["num_programs"] == 8
    radix, none = doc["variants"]
    assert "--cache" in radix["server_args"] and "radix" in radix["server_args"]
    for v in (radix, none):
        check_run(v["metrics"], v["requests"])
    m = radix["metrics"]
    assert m["cached_tokens"] > 0 and 0 < m["hit_vs_optimal"] <= 1
    assert none["metrics"]["cached_tokens"] == 0 and none["metrics"]["hit_rate"] == 0
    assert none["metrics"]["hit_vs_optimal"] == 0


def test_programs_against_a_server(model_dir, tmp_path, capsys):
    server = Server(model_dir, "--page-size", "4", "--num-pages", "4096")
    try:
        out = tmp_path / "server"
        assert radixserve_main(bench(model_dir, out, "--endpoint", server.endpoint)) == 0
    finally:
        assert server.stop() == 0
    (v,) = json.loads(out.with_suffix(".json").read_text())["variants"]
    assert v["backend"] == "radixserve" and v["cache_flushed_before_run"]
    check_run(v["metrics"], v["requests"])
    assert 0 < v["metrics"]["hit_vs_optimal"] <= 1


def test_the_openai_backend_is_refused(model_dir, tmp_path):
    argv = bench(model_dir, tmp_path / "x", "--backend", "openai", "--base-url", "http://h/v1")
    with pytest.raises(SystemExit, match="programs send token ids"):
        radixserve_main(argv)
