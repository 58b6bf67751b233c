"""``radixserve bench program --compare cache=radix,none`` end to end through the
in-process Engine backend, on a tiny chat model.

Every program finishes; every request the programs sent is recorded with the
server's usage; with the radix cache the forks' shared contexts come from the
cache, at most what the offline optimum over the same requests allows; without
a cache nothing does.
"""

from __future__ import annotations

import json

import pytest

from radixserve.cli import main as radixserve_main
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


def test_programs_hit_the_cache_within_the_optimum(model_dir, tmp_path, capsys):
    out = tmp_path / "programs"
    argv = ["bench", "program", "--program", "all", "--programs", "2", "--output-len", "6"]
    argv += ["--model", str(model_dir), "--backend", "engine", "--server-args", ENGINE_FLAGS]
    argv += ["--compare", "cache=radix,none", "--no-progress", "--no-plot"]
    argv += ["--output", str(out)]
    assert radixserve_main(argv) == 0

    table = capsys.readouterr().out
    assert "programs/s" in table and "hit / optimal" in table and "cache=none" in table
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["workload"] == "program" and doc["num_programs"] == 8
    radix, none = doc["variants"]
    assert "--cache" in radix["server_args"] and "radix" in radix["server_args"]
    for v in (radix, none):
        m = v["metrics"]
        assert m["programs"] == 8 and m["programs_failed"] == 0, m["program_errors"]
        assert m["failed"] == 0, m["errors"]
        rows = v["requests"]
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
    m = radix["metrics"]
    assert m["cached_tokens"] > 0 and 0 < m["hit_vs_optimal"] <= 1
    assert none["metrics"]["cached_tokens"] == 0 and none["metrics"]["hit_rate"] == 0
    assert none["metrics"]["hit_vs_optimal"] == 0
