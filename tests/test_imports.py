"""The processes that need no tensors import no torch (nor the model stack)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_FREE = [
    "radixserve.config",
    "radixserve.cli",
    "radixserve.scheduler.process",
    "radixserve.tokenizer.process",
    "radixserve.models.source",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str):
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('torch', 'radixserve.models.llama', 'radixserve.engine')"
        " if m in sys.modules)\n"
        "print(' '.join(heavy))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [], f"importing {module} imports {proc.stdout.strip()}"
