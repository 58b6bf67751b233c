"""Skipping tests of an optional native extension that is not built, or of a kernel
path this CPU does not run.

A missing build skips the test, except when ``RADIXSERVE_REQUIRE_NATIVE=1``
(what CI sets): then it fails, so a broken C++ build cannot pass unnoticed. A
missing CPU feature always skips (CI machines differ in what they have).
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


def require_isa(isa: str) -> str:
    """Return ``isa`` if the CPU kernels are built and this CPU runs that level; skip
    (with the reason) otherwise."""
    from radixserve.layers import cpu_kernels

    require_built(cpu_kernels.AVAILABLE, cpu_kernels.UNAVAILABLE_REASON, "native CPU kernels")
    if isa not in cpu_kernels.supported_isas():
        pytest.skip(
            f"this CPU does not run the {isa} kernels (it runs: "
            f"{', '.join(cpu_kernels.supported_isas())})"
        )
    return isa
