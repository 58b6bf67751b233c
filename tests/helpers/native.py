"""Skipping tests of an optional native extension that is not built.

A missing build skips the test, except when ``RADIXSERVE_REQUIRE_NATIVE=1``
(what CI sets): then it fails, so a broken C++ build cannot pass unnoticed.
"""

from __future__ import annotations

import os

import pytest


def require_built(available: bool, reason: str, what: str, module: bool = False) -> None:
    """Return if ``what`` is built; else fail under RADIXSERVE_REQUIRE_NATIVE=1, skip
    otherwise (the whole test module when ``module``: call it at import time)."""
    if available:
        return
    message = f"{what} not built ({reason}); build it with `python setup.py build_ext --inplace`"
    if os.environ.get("RADIXSERVE_REQUIRE_NATIVE") == "1":
        pytest.fail(message)
    pytest.skip(message, allow_module_level=module)
