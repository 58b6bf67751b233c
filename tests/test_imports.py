"""Import boundaries: the processes that need no tensors import no torch (nor the model
stack), and the model layers import nothing above them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_FREE = [
    "radixserve.config",
    "radixserve.compose",
    "radixserve.cli",
    "radixserve.scheduler.process",
    "radixserve.tokenizer.process",
    "radixserve.models.source",
]


def imported_with(module: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules whose names start with one of ``prefixes`` that importing ``module``
    in a fresh interpreter brings in."""
    code = (
        f"import sys, {module}\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str):
    heavy = imported_with(module, ("torch", "radixserve.models.decoder", "radixserve.engine"))
    assert heavy == [], f"importing {module} imports {heavy}"


@pytest.mark.parametrize(
    ("module", "above"),
    [
        ("radixserve.models.loader", ("radixserve.worker",)),
        ("radixserve.layers.linear", ("radixserve.worker", "radixserve.models")),
    ],
)
def test_lower_layers_import_nothing_above_them(module: str, above: tuple[str, ...]):
    found = imported_with(module, above)
    assert found == [], f"importing {module} imports {found}"
