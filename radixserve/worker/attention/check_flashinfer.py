"""``python -m radixserve.worker.attention.check_flashinfer``: check a GPU install.

The command line of the FlashInfer selection: it builds a backend the way a worker
does (``create_backend("auto", ...)``: the static rules, then the probe of
``flashinfer_probe.py``) for one attention shape, and prints the verdict and the
prefill backend; the probe logs what each wrapper's plans ran on (fa2 / fa3). It sits
above the attention package (nothing imports it), so the probe module below
needs no import of the package that imports it.
"""

from __future__ import annotations

import logging
import time

import torch

from radixserve.worker.attention import create_backend
from radixserve.worker.kv_pool import KVPool


def main(argv: list[str] | None = None) -> int:
    """``python -m radixserve.worker.attention.check_flashinfer``: check a GPU install.

    Runs the selection (static rules, then the probe) for one attention shape and prints
    each warm-up step and the verdict; exit status 0 when flashinfer would be chosen.
    The first run JIT-builds the kernels (into FlashInfer's cache) unless prebuilt.
    """
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--windows",
        default="-1",
        help="comma-separated sliding windows, -1: none (--windows=-1,4096)",
    )
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--prefill-backend", default="auto", choices=["auto", "fa2", "fa3"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    windows = tuple(int(w) for w in args.windows.split(","))
    pool = KVPool(len(windows), 8, args.page_size, args.kv_heads, args.head_dim,
                  getattr(torch, args.dtype), args.device)  # fmt: skip
    start = time.perf_counter()
    backend = create_backend(
        "auto", pool, args.head_dim**-0.5, windows, args.heads, softcap=args.softcap,
        flashinfer_options={"prefill_backend": args.prefill_backend},
    )  # fmt: skip
    print(f"attention backend: {backend.name} ({backend.choice_reason}) "
          f"in {time.perf_counter() - start:.1f} s")  # fmt: skip
    if backend.name == "flashinfer":  # what the probe's wrappers ran on is logged above
        print(f"prefill backend: {backend.prefill_backend_reason}")
    return 0 if backend.name == "flashinfer" else 1


if __name__ == "__main__":
    raise SystemExit(main())
