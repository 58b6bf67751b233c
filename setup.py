"""Build of the optional native radix tree (csrc/); everything else is in pyproject.toml.

The extension is optional: when it cannot be built (no C++17 compiler, no
pybind11 in a --no-build-isolation environment, a compile error) the install
still succeeds, prints why, and radixserve uses the Python tree. Ask for it
explicitly with ``make_radix_cache(..., impl="native")`` to get a clear error.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

EXT_NAME = "radixserve.scheduler._radix_native"
SOURCES = ["csrc/radix_tree.cpp", "csrc/page_free.cpp", "csrc/bindings.cpp"]
KERNELS_EXT_NAME = "radixserve.layers._cpu_kernels"
RELAY_EXT_NAME = "radixserve.utils._zmtp_relay"
ZMTP_SERVER_EXT_NAME = "radixserve.utils._zmtp_server"
POLL_KEEPER_EXT_NAME = "radixserve.http._poll_keeper"
# Not a Python module: a library the launcher preloads into a prefill/decode server's
# worker so the transfer engine's listeners bind --kv-transfer-host (csrc/bind_address.c).
BIND_EXT_NAME = "radixserve.worker._bind_address"
KERNELS_SOURCES = [
    "csrc/paged_attention.cpp",
    "csrc/skinny_gemm.cpp",
    "csrc/rms_norm.cpp",
    "csrc/argmax.cpp",
    "csrc/lse_merge.cpp",
    "csrc/add_rms_norm.cpp",
    "csrc/rotary.cpp",
    "csrc/step_bindings.cpp",
    "csrc/decode_layers.cpp",
    "csrc/kv_rows.cpp",
    "csrc/amx_gemm.cpp",
    "csrc/amx_attention.cpp",
    "csrc/prefix_attention.cpp",
    "csrc/gated_delta.cpp",
    "csrc/mamba2_step.cpp",
    "csrc/cpu_kernels.cpp",
]


_warned: set[str] = set()


def _warn(reason: str, name: str = EXT_NAME) -> None:
    if name in _warned:  # one failure tends to cascade (e.g. the copy of the missing .so)
        return
    _warned.add(name)
    bar = "=" * 78
    fallback = {
        EXT_NAME: "Python radix tree",
        RELAY_EXT_NAME: "routing-id gate's Python relay",
        ZMTP_SERVER_EXT_NAME: "routing-id gate's relay to the ROUTER",
        POLL_KEEPER_EXT_NAME: "HTTP front's own answers to dashboard polls",
        BIND_EXT_NAME: "transfer engine's listeners on every interface (--disaggregation)",
    }.get(name, "torch decode path and BLAS")
    print(
        f"\n{bar}\nWARNING: the native extension {name} was not built:\n  {reason}\n"
        f"radixserve installs anyway and uses the {fallback}.\n"
        "To build it: install a C++17 compiler, then `pip install -e .` again\n"
        "(or `python setup.py build_ext --inplace` in a checkout).\n"
        f"{bar}\n",
        file=sys.stderr,
        flush=True,
    )


class OptionalBuildExt(build_ext):
    """build_ext that downgrades a failed native build to a warning, and builds the
    extensions side by side (their sources too: ``_parallel_compile``)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None and self.extensions:  # every extension at once
            self.parallel = len(self.extensions)

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # the toolchain may fail in many ways; none is fatal
            _warn(f"{type(e).__name__}: {e}")

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            _warn(f"{type(e).__name__}: {e}", ext.name)


#: The variable that sets how many C++ files compile at once (default: one per CPU).
JOBS_ENV = "RADIXSERVE_BUILD_JOBS"


def _parallel_compile() -> None:
    """Compile each extension's sources side by side (pybind11's ``ParallelCompile``):
    the longest file (``csrc/paged_attention.cpp``, every ISA level's instantiations)
    starts first and the rest fill the other cores, about half the serial time on 2
    cores (docs/native.md, "How it is built")."""
    try:
        from pybind11.setup_helpers import ParallelCompile
    except ImportError:
        return
    ParallelCompile(JOBS_ENV, default=0).install()


def _relay_extension() -> list:
    """The routing-id gate's relay (plain C, Linux: epoll and splice); without it the
    gate relays in Python. Its ZMTP server for NULL connections (plain C, Linux:
    epoll); without it they are relayed to the ROUTER. The HTTP front's poll keeper
    (plain C, Linux: epoll); without it the front's protocol answers every poll. And
    the bind-address library (plain C, Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    return [
        Extension(
            RELAY_EXT_NAME,
            ["csrc/zmtp_relay.c"],
            depends=["csrc/zmtp_gone.h", "csrc/native_thread.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            ZMTP_SERVER_EXT_NAME,
            ["csrc/zmtp_server.c"],
            depends=["csrc/zmtp_gone.h", "csrc/native_thread.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            POLL_KEEPER_EXT_NAME,
            ["csrc/poll_keeper.c"],
            depends=["csrc/native_thread.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            BIND_EXT_NAME,
            ["csrc/bind_address.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            libraries=["dl"],
        ),
    ]


def _extensions() -> list:
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        _warn("pybind11 is not importable (with --no-build-isolation, `pip install pybind11`)")
        return _relay_extension()
    exts = [
        Pybind11Extension(
            EXT_NAME,
            SOURCES,
            include_dirs=["csrc"],
            depends=["csrc/radix_tree.h", "csrc/page_free.h"],  # rebuild on header edits
            cxx_std=17,
            extra_compile_args=["-O3", "-Wall", "-Wextra"] if sys.platform != "win32" else [],
        )
    ]
    if sys.platform.startswith("linux"):  # needs GCC/clang with OpenMP
        exts.append(
            Pybind11Extension(
                KERNELS_EXT_NAME,
                KERNELS_SOURCES,
                include_dirs=["csrc"],
                depends=["csrc/cpu_kernels.h", "csrc/step_bindings.h"],
                cxx_std=17,
                extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-psabi", "-fopenmp"],
                extra_link_args=["-fopenmp"],
            )
        )
    return exts + _relay_extension()


_parallel_compile()
setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
