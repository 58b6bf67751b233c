"""``radixserve launch``'s command line into a ``ServerConfig`` and ``radixserve
router``'s into a ``RouterConfig``: one flag derived from each option of their configs,
the few others listed apart, the options' checks at parse time and in the configs, the
host tier ``--disk-cache-dir`` gets by itself, and the refusal that names what to pass."""

from __future__ import annotations

from dataclasses import fields

import pytest

from radixserve.cli import build_parser, main
from radixserve.config import MODEL_FIELDS, EngineConfig, ModelInfo, scheduler_config
from radixserve.launch_flags import (
    HOST_TIER_CAP_GB,
    NON_OPTION_FLAGS,
    available_memory,
    config_from_args,
    default_host_cache_gb,
    launch_parser,
)
from radixserve.options import flag_of, nested_of, option_of
from radixserve.router import cli as router_cli
from radixserve.router.config import RouterConfig
from radixserve.router.policy import PolicyConfig
from radixserve.sampling_params import MAX_N
from radixserve.scheduler.config import SchedulerConfig
from radixserve.server_config import TOOL_CALL_PARSERS, ServerConfig
from radixserve.tokenizer.config import TokenizerConfig
from radixserve.utils.descriptors import ConnectionOptions
from radixserve.worker.config import WorkerConfig

GIB = 1024**3
INFO = ModelInfo(
    num_pages=64,
    page_size=1,
    max_context_len=256,
    vocab_size=512,
    eos_token_ids=(2,),
    model_name="tiny",
    backend_name="torch",
    dtype="float32",
    dtype_reason="as asked",
)


def launch(*flags: str):
    return config_from_args(build_parser().parse_args(["launch", *flags])).engine


def option_names(cls: type) -> list[str]:
    """The options of ``cls``, its ``nested`` configs' included."""
    names: list[str] = []
    for f in fields(cls):
        names += option_names(nested_of(f)) if nested_of(f) else [f.name] * bool(option_of(f))
    return names


def flags_by_dest(parser) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for action in parser._actions:
        if action.dest not in ("help", "command"):
            flags.setdefault(action.dest, []).extend(action.option_strings)
    return flags


def assert_one_flag_each(flags: dict[str, list[str]], options: list[str], others) -> None:
    declared = options + list(others)
    assert len(declared) == len(set(declared)), "an option declared twice"
    assert set(flags) == set(declared)
    for name in options:
        flag = flag_of(name)
        assert flags[name] in ([flag], [flag, "--no-" + flag[2:]]), name
    for name in others:
        assert len(flags[name]) == 1, name


def test_every_option_has_exactly_one_flag_and_every_flag_one_option():
    engine = option_names(EngineConfig)
    assert engine == [f.name for f in fields(EngineConfig)]  # every engine field
    options = engine + option_names(ServerConfig)
    options += option_names(ConnectionOptions) + option_names(PolicyConfig)
    assert_one_flag_each(flags_by_dest(launch_parser()), options, NON_OPTION_FLAGS)


def test_every_router_option_has_exactly_one_flag_and_every_flag_one_option():
    router = build_parser()._subparsers._group_actions[0].choices["router"]
    options = option_names(RouterConfig)
    assert set(option_names(PolicyConfig)) | set(option_names(ConnectionOptions)) < set(options)
    assert_one_flag_each(flags_by_dest(router), options, router_cli.NON_OPTION_FLAGS)


def test_a_router_config_runs_a_router_of_that_config():
    # What ``radixserve launch --dp`` does: its router's config out as flags, read back.
    config = RouterConfig(
        ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
        port=0,
        model="/models/tiny",
        policy=PolicyConfig("least_load", balance_abs_threshold=8, cache_threshold=0.5),
        curve_allow_any_client=True,
        connections=ConnectionOptions(max_connections=10, handshake_timeout=2.5),
        ipc_endpoint="ipc:///tmp/front",
        exit_with_parent=True,
        log_level="info",
    )
    line = router_cli.command_line(config)
    args = build_parser().parse_args(["router", *line])
    assert router_cli.config_from_args(args) == config
    assert "--max-message-bytes" not in line  # not an option: no flag
    assert router_cli.config_from_args(
        build_parser().parse_args(["router", "--replica", "tcp://127.0.0.1:1"])
    ) == RouterConfig(("tcp://127.0.0.1:1",))


def test_the_routers_options_are_checked_by_flag_and_by_config(capsys):
    for flag, value in (
        ("--cache-threshold", "1.5"),
        ("--balance-rel-threshold", "0.5"),
        ("--policy", "random"),
        ("--max-connections", "-1"),
        ("--handshake-timeout", "inf"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["router", "--replica", "tcp://h:1", flag, value])
        assert flag in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"cache_threshold must be in \[0, 1\], got 1.5"):
        PolicyConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="max_connections must be >= 0, got -1"):
        RouterConfig(("tcp://h:1",), connections=ConnectionOptions(max_connections=-1))
    with pytest.raises(ValueError, match="unsupported log_level 'loud'"):
        RouterConfig(("tcp://h:1",), log_level="loud")


def test_choices_listed_apart_from_their_code_are_the_ones_it_has():
    # The server's config imports nothing of the HTTP front: the parsers' names are
    # listed there apart from the parsers themselves.
    from radixserve.http.tool_parsers import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


def test_library_fields_are_options_but_the_model_facts():
    for cls in (WorkerConfig, TokenizerConfig):
        assert all(option_of(f) for f in fields(cls)), cls
    settable = {f.name for f in fields(SchedulerConfig) if option_of(f)}
    assert settable == {f.name for f in fields(SchedulerConfig)} - set(MODEL_FIELDS)


def test_an_option_out_of_its_range_or_choices_is_refused_by_flag_and_by_config(capsys):
    for flag, value in (
        ("--max-retained-share", "1.5"),
        ("--dist-timeout", "0"),
        ("--max-n", str(MAX_N + 1)),
        ("--sliding-pool-pages", "-1"),
        ("--decode-kernel", "cuda"),
        ("--page-size", "x"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["launch", flag, value])
        assert flag in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"max_retained_share must be in \[0, 1\], got 1.5"):
        scheduler_config(EngineConfig(max_retained_share=1.5), INFO)
    with pytest.raises(ValueError, match="unsupported decode_kernel 'cuda'"):
        WorkerConfig(decode_kernel="cuda")
    with pytest.raises(ValueError, match=rf"max_n must be in \[1, {MAX_N}\], got 0"):
        TokenizerConfig(max_n=0)
    with pytest.raises(ValueError, match="max_stop must be given"):
        TokenizerConfig(max_stop=None)
    assert WorkerConfig(state_snapshots=None).state_snapshots is None  # None: derived
    with pytest.raises(ValueError, match="name=path, got 'adapter'"):
        WorkerConfig(lora_modules=("adapter",))
    with pytest.raises(ValueError, match="unsupported kv_events_format 'json'"):
        ServerConfig(kv_events_format="json")
    with pytest.raises(ValueError, match="nnodes must be >= 1, got 0"):
        ServerConfig(nnodes=0)


def test_the_default_host_tier_is_a_quarter_of_free_memory_in_half_gib():
    assert default_host_cache_gb(8 * GIB) == 2.0
    assert default_host_cache_gb(int(7.9 * GIB)) == 1.5  # 1.975 rounds down
    assert default_host_cache_gb(0) == 0.5  # the system does not say: still a tier
    assert default_host_cache_gb(1000 * GIB) == HOST_TIER_CAP_GB


def test_disk_cache_dir_alone_gets_a_host_tier_and_says_its_size(tmp_path, capsys):
    engine = launch("--disk-cache-dir", str(tmp_path))
    assert engine.host_cache_gb == default_host_cache_gb(available_memory()) > 0
    err = capsys.readouterr().err
    assert f"a {engine.host_cache_gb:g} GiB host tier" in err
    assert "--host-cache-gb N" in err


def test_no_disk_tier_no_host_tier_and_a_given_size_is_kept(tmp_path, capsys):
    assert launch().host_cache_gb == 0.0
    assert launch("--host-cache-gb", "3", "--disk-cache-dir", str(tmp_path)).host_cache_gb == 3.0
    assert capsys.readouterr().err == ""  # nothing chosen for the user, nothing printed


def test_disk_tier_with_host_tier_off_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"pass --host-cache-gb N"):
        launch("--host-cache-gb", "0", "--disk-cache-dir", str(tmp_path))
    assert main(["launch", "--host-cache-gb", "0", "--disk-cache-dir", str(tmp_path)]) == 1
    assert "--host-cache-gb N" in capsys.readouterr().err
