"""lm-eval as a real client: its ``local-completions`` model against the HTTP
front must score like lm-eval's own ``hf`` model on the same SmolLM2 weights.

Two small local tasks written here (no hub): a multiple-choice task scored by
loglikelihood (``echo`` + ``logprobs`` on token-id prompts) and a
``generate_until`` task (stop strings, greedy). Per sample, the
loglikelihoods agree within 1e-4 (float32 on both sides) and the choices,
generations and metrics are the same. docs/http.md has the recipe.
"""

from __future__ import annotations

import json

import pytest

from radixserve.models.embedded import ensure_smollm2
from tests.helpers.server import Server

lm_eval = pytest.importorskip("lm_eval")

MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "yellow"], 2),
    ("Which animal says meow?", ["dog", "cow", "cat", "duck"], 2),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("Which season is the coldest?", ["summer", "winter", "spring", "autumn"], 1),
]
GEN = [
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the opposite of up?", "Down"),
    ("What color is grass?", "Green"),
]


def write_tasks(folder) -> None:
    data = folder / "data"
    data.mkdir()
    with open(data / "mc.jsonl", "w") as f:
        for q, choices, label in MC:
            f.write(json.dumps({"question": q, "choices": choices, "label": label}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for q, a in GEN:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    # Data paths are absolute: lm-eval resolves them from the working directory.
    (folder / "rs_mc.yaml").write_text(
        f"""task: rs_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / "mc.jsonl"}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
    )
    (folder / "rs_gen.yaml").write_text(
        f"""task: rs_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / "gen.jsonl"}
output_type: generate_until
test_split: test
doc_to_text: "Question: What is the capital of Peru?\\nAnswer: Lima\\n\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""
    )


def evaluate(tasks_dir, model: str, model_args: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["rs_mc", "rs_gen"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=1,
        device="cpu",
        log_samples=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, monkeypatch_module):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch_module.setenv(var, "1")
    folder = tmp_path_factory.mktemp("lm-eval")
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(folder / "datasets"))
    tasks = folder / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    weights = ensure_smollm2()
    srv = Server(
        "smollm2", "--dtype", "float32", "--http-port", "0", "--served-model-name", "smollm2",
        "--no-warmup",
    )  # fmt: skip
    try:
        url = srv.http_url + "/v1/completions"
        args = (
            f"model=smollm2,base_url={url},tokenizer={weights},tokenizer_backend=huggingface,"
            "num_concurrent=1,max_retries=1"
        )
        served = evaluate(tasks, "local-completions", args)
    finally:
        assert srv.stop() == 0
    reference = evaluate(tasks, "hf", f"pretrained={weights},dtype=float32")
    return served, reference


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_loglikelihoods_and_accuracy_equal_the_hf_model(runs):
    served, reference = runs
    got, want = served["samples"]["rs_mc"], reference["samples"]["rs_mc"]
    assert len(got) == len(want) == len(MC)
    for a, b in zip(
        sorted(got, key=lambda s: s["doc_id"]), sorted(want, key=lambda s: s["doc_id"])
    ):
        lls_a = [float(r[0]) for r in a["filtered_resps"]]
        lls_b = [float(r[0]) for r in b["filtered_resps"]]
        assert lls_a == pytest.approx(lls_b, abs=1e-4)
        assert a["acc"] == b["acc"] and a["acc_norm"] == b["acc_norm"]
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["rs_mc"][metric] == reference["results"]["rs_mc"][metric]


def test_generations_equal_the_hf_model(runs):
    served, reference = runs
    got = sorted(served["samples"]["rs_gen"], key=lambda s: s["doc_id"])
    want = sorted(reference["samples"]["rs_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"] for s in got] == [s["resps"] for s in want]
    assert all(r[0][0].strip() for r in (s["resps"] for s in got))  # real answers, not empty
    em = "exact_match,strip"
    assert served["results"]["rs_gen"][em] == reference["results"]["rs_gen"][em]
