"""Run tests once more as a CPU without AMX and AVX512_BF16 would (AMD Zen 4 takes
the ``avx512`` paths of our kernels and of oneDNN/MKL but no AMX; Intel Ice Lake the
same; older CPUs ``avx2``), whatever CPU this is.

    python -m tests.masked_isa [pytest args]   (no test paths among them: MASKED_TESTS)

It picks the best level below ``avx512bf16`` this CPU runs and sets, for the pytest
process it starts:

- ``RADIXSERVE_CPU_ISA`` to that level and ``RADIXSERVE_CPU_AMX=0`` (our kernels and
  ``Linear``'s dispatch, read when ``radixserve.layers.cpu_kernels`` loads);
- ``ONEDNN_MAX_CPU_ISA`` (oneDNN's bfloat16 products: no AMX, no AVX512_BF16) and
  ``MKL_ENABLE_INSTRUCTIONS`` (MKL's float32/float64 products) to the same level.

Tests that take an explicit ``isa=`` still run every level the CPU has; what this
adds is every process-wide choice made at the lower level (``make test`` runs it
after the suite; docs/cpu-kernels.md, "Which paths a CPU takes").
"""

from __future__ import annotations

import os
import subprocess
import sys

#: The tests whose outcome depends on the process's level: batch invariance (the
#: products' and attention's dispatch) and the one-call decode step against the
#: layers. (The kernels' own tests pass ``isa=`` and run every level in the suite.)
MASKED_TESTS = [
    "tests/layers/test_invariant.py",
    "tests/layers/test_decode_layers.py",
    "tests/test_deterministic.py",
]

#: Our level -> (oneDNN's cap, MKL's cap).
CAPS = {
    "avx512": ("AVX512_CORE", "AVX512"),
    "avx2": ("AVX2", "AVX2"),
    "baseline": ("SSE41", "SSE4_2"),
}


def masked_env(supported: tuple[str, ...], env: dict[str, str]) -> dict[str, str]:
    """``env`` with the four variables set for the best level in ``supported`` below
    ``avx512bf16`` (``baseline`` if none)."""
    level = next((lv for lv in ("avx512", "avx2") if lv in supported), "baseline")
    onednn, mkl = CAPS[level]
    return {
        **env,
        "RADIXSERVE_CPU_ISA": level,
        "RADIXSERVE_CPU_AMX": "0",
        "ONEDNN_MAX_CPU_ISA": onednn,
        "MKL_ENABLE_INSTRUCTIONS": mkl,
    }


def main(argv: list[str]) -> int:
    from radixserve.layers import cpu_kernels

    env = masked_env(cpu_kernels.supported_isas(), dict(os.environ))
    print(
        f"masked run: RADIXSERVE_CPU_ISA={env['RADIXSERVE_CPU_ISA']} RADIXSERVE_CPU_AMX=0 "
        f"ONEDNN_MAX_CPU_ISA={env['ONEDNN_MAX_CPU_ISA']} "
        f"MKL_ENABLE_INSTRUCTIONS={env['MKL_ENABLE_INSTRUCTIONS']}",
        flush=True,
    )
    paths = [a for a in argv if not a.startswith("-")]
    args = argv if paths else [*MASKED_TESTS, *argv]
    return subprocess.call(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], env=env
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
