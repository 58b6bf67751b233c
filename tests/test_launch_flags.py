"""``radixserve launch``'s command line into a ``ServerConfig``: the host tier
``--disk-cache-dir`` gets by itself, and the refusal that names what to pass."""

from __future__ import annotations

import pytest

from radixserve.cli import build_parser, main
from radixserve.launch_flags import (
    HOST_TIER_CAP_GB,
    available_memory,
    config_from_args,
    default_host_cache_gb,
)

GIB = 1024**3


def launch(*flags: str):
    return config_from_args(build_parser().parse_args(["launch", *flags])).engine


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
