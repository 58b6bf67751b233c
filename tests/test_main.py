"""``python -m radixserve`` is the ``radixserve`` command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "radixserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_the_subcommands():
    proc = run_module("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: radixserve")
    assert "launch" in proc.stdout and "bench" in proc.stdout


@pytest.mark.parametrize(
    ("command", "flag"), [("launch", "--max-running-requests"), ("bench", "--endpoint")]
)
def test_subcommand_help(command: str, flag: str):
    proc = run_module(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: radixserve {command}")
    assert flag in proc.stdout


def test_unknown_subcommand_is_a_usage_error():
    proc = run_module("no-such-command")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
