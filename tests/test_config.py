"""One source of options: EngineConfig, the configs derived from it, the CLI, the docs."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from radixserve.cli import build_parser, config_from_args
from radixserve.config import (
    MODEL_FIELDS,
    EngineConfig,
    ModelInfo,
    scheduler_config,
    worker_config,
)
from radixserve.scheduler.config import SchedulerConfig
from radixserve.server_config import ServerConfig
from radixserve.tokenizer.config import TokenizerConfig
from radixserve.worker.config import WorkerConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
INFO = ModelInfo(
    num_pages=77,
    page_size=4,
    max_context_len=300,
    vocab_size=512,
    eos_token_ids=(2, 5),
    model_name="tiny",
    backend_name="torch",
    dtype="float32",
    dtype_reason="as asked",
)
ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


def defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def test_every_library_option_is_an_engine_option_with_the_same_default():
    engine = defaults(EngineConfig)
    libraries = ((WorkerConfig, ()), (SchedulerConfig, MODEL_FIELDS), (TokenizerConfig, ()))
    for cls, model_fields in libraries:
        for name, value in defaults(cls).items():
            if name in model_fields:
                continue
            assert name in engine, f"{cls.__name__}.{name} cannot be set from the Engine"
            assert engine[name] == value, f"{name}: {engine[name]!r} vs {value!r}"
        required = [f.name for f in fields(cls) if f.default is MISSING]
        assert set(required) <= set(model_fields)


def test_every_engine_option_reaches_a_library_config():
    used = {f.name for cls in (WorkerConfig, SchedulerConfig, TokenizerConfig) for f in fields(cls)}
    assert used >= ENGINE_FIELDS


def test_derived_configs_carry_the_options_and_the_model_facts():
    cfg = EngineConfig(
        model="m",
        page_size=4,
        max_running_requests=7,
        lpm_max_waiting=3,
        max_wait_steps=9,
        decode_reserve_ratio=0.5,
        shared_prefix_min_tokens=16,
        schedule_policy="fcfs",
        num_pages=12,
        seed=3,
    )
    w = worker_config(cfg)
    assert (w.model, w.page_size, w.max_running_requests, w.num_pages, w.seed) == (
        "m",
        4,
        7,
        12,
        3,
    )
    s = scheduler_config(cfg, INFO)
    assert (s.num_pages, s.page_size, s.max_context_len, s.eos_token_ids) == (77, 4, 300, (2, 5))
    assert (s.lpm_max_waiting, s.max_wait_steps, s.shared_prefix_min_tokens) == (3, 9, 16)
    assert (s.decode_reserve_ratio, s.schedule_policy, s.max_running_requests) == (0.5, "fcfs", 7)
    with pytest.raises(ValueError, match="page size"):
        scheduler_config(EngineConfig(page_size=1), INFO)


def launch_parser():
    return build_parser()._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]


def test_every_engine_option_has_a_launch_flag_with_its_default():
    dests = {a.dest: a.option_strings for a in launch_parser()._actions}
    for name in ENGINE_FIELDS:
        flag = "--" + name.replace("_", "-")
        # one flag each; a boolean option also has its --no- form
        assert dests.get(name) in ([flag], [flag, "--no-" + flag[2:]]), name
    assert config_from_args(build_parser().parse_args(["launch"])).engine == EngineConfig()


def test_launch_flags_reach_the_config():
    args = build_parser().parse_args(
        ["launch", "--lpm-max-waiting", "5", "--max-wait-steps", "0"]
        + ["--decode-reserve-ratio", "0.25", "--shared-prefix-min-tokens", "64"]
    )
    engine = config_from_args(args).engine
    assert (engine.lpm_max_waiting, engine.max_wait_steps) == (5, 0)
    assert (engine.decode_reserve_ratio, engine.shared_prefix_min_tokens) == (0.25, 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--decode-reserve-ratio", "1.5"])


def test_docs_list_every_launch_flag_and_only_settable_scheduler_options():
    serving = (DOCS / "serving.md").read_text()
    for action in launch_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}`" in serving, f"docs/serving.md does not list {flag}"
    scheduler = (DOCS / "scheduler.md").read_text()
    table = scheduler.split("## Defaults", 1)[1].split("\n## ", 1)[0]
    options = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    assert "lpm_max_waiting" in options
    for name in options:
        assert name in ENGINE_FIELDS or name == "max_tokens", name  # max_tokens: SamplingParams


def test_server_config_round_trips_with_model_info():
    cfg = ServerConfig(engine=EngineConfig(page_size=4, max_wait_steps=3), run_dir="/tmp/x")
    cfg = cfg.with_model({**INFO.__dict__, "eos_token_ids": [2, 5]})
    assert cfg.model == INFO
    assert ServerConfig.from_json(cfg.to_json()) == cfg
