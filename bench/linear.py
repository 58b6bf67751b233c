"""Linear-layer benchmark: one decode step's matmuls in each of ``Linear``'s product forms.

The weights have SmolLM2-135M's shapes (30 layers of qkv 960x576, o 576x576,
gate_up 3072x576 and down 576x1536; random values, float32 (about 425 MB) or
bfloat16 (``--dtype``, 212 MB): every step streams them from memory, as a decode
step does). A step multiplies ``rows`` activation rows (of the same dtype)
through all of them in one form:

- ``kernel <isa>``: csrc/'s ``skinny_gemm`` (``layers/cpu_kernels.py``) at each
  instruction-set level of ``--isa`` (default: every level this CPU runs);
- ``kernel amx``: ``skinny_gemm``'s AMX form (bfloat16 on a CPU with AMX tiles);
- ``weight-major``: ``(W x^T)^T`` through BLAS (oneDNN for bfloat16);
- ``x W^T``: ``F.linear``, BLAS's usual form;
- ``Linear``: ``layers/linear.py``'s own choice among the above (and, for bfloat16
  where torch has no fast product, float32 BLAS over widened weights).

The forms take turns inside each round, so a drift in the machine's speed hits
all of them. Each round keeps each form's fastest of ``--steps`` steps; the
tables show the median over ``--rounds`` rounds of that time, and of the ratio
``x W^T`` time / form time within a round (above 1: faster than ``F.linear``).
``layers/linear.py``'s row limits come from such runs (bench/results/linear.md).

    python bench/linear.py                               # rows 1,16,32,48,64,512
    python bench/linear.py --rows 16 --rounds 3 --threads 1
    python bench/linear.py --dtype bfloat16 --rows 1,8,16,32 --isa avx512,avx512bf16
    python bench/linear.py --dtype bfloat16 --rows 8 --isa avx512bf16:dot,avx512bf16:dot16
    python bench/linear.py --dtype bfloat16 --rows 2,8,32 --feature-major --lm-head
    python bench/linear.py --dtype bfloat16 --rows 1,8,32,64,512 --rounds 3   # an AVX2 CPU

``--feature-major`` hands the products x as the transposed view of a ``[features,
rows]`` tensor (how the layers pass activations from one product to the next);
``--lm-head`` adds SmolLM2's tied LM head (49152 x 576) to every step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.linear import linear

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weight_major(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()


def kernel(isa: str, form: str = "auto") -> Form:
    return lambda x, w: cpu_kernels.skinny_linear(x, w, None, isa=isa, form=form)


def amx(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.skinny_linear(x, w, None, amx=True)


def x_wt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def make_layers(seed: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
    return [
        tuple((torch.randn(*s, generator=g) * 0.02).to(dtype) for s in shapes)
        for _ in range(LAYERS)
    ]


def step_time(
    form: Form,
    layers: list[tuple[torch.Tensor, ...]],
    rows: int,
    steps: int,
    feature_major: bool = False,
    head: torch.Tensor | None = None,
) -> float:
    """Seconds of the fastest of ``steps`` steps: every layer's four products on ``rows``
    rows (and the LM head once, when given)."""
    dtype = layers[0][0].dtype
    x = torch.randn(rows, HIDDEN).to(dtype)
    mid = torch.randn(rows, INTERMEDIATE).to(dtype)
    if feature_major:
        x, mid = x.t().contiguous().t(), mid.t().contiguous().t()
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        for qkv, o, gate_up, down in layers:
            form(x, qkv)
            form(x, o)
            form(x, gate_up)
            form(mid, down)
        if head is not None:
            form(x, head)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,32,48,64,512", help="activation rows per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per form per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--isa", default="", help="kernel levels to time, e.g. avx2,avx512 "
                    "(default: every level this CPU runs); avx512bf16:dot times one of "
                    "its forms (cpu_kernels.SKINNY_FORMS)")  # fmt: skip
    ap.add_argument("--feature-major", action="store_true",
                    help="x as the transposed view of [features, rows]")  # fmt: skip
    ap.add_argument("--lm-head", action="store_true", help="add a 49152 x 576 LM head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    forms: dict[str, Form] = {"weight-major": weight_major, "x W^T": x_wt, "Linear": linear}
    if cpu_kernels.AVAILABLE:
        isas = [i for i in args.isa.split(",") if i] or list(cpu_kernels.supported_isas())
        kernels = {}
        for name in isas:
            level, _, form = name.partition(":")
            kernels[f"kernel {name}"] = kernel(cpu_kernels.resolve_isa(level), form or "auto")
        forms = {**kernels, **forms}
        if args.dtype == "bfloat16" and cpu_kernels.amx_supported():
            forms = {"kernel amx": amx, **forms}
    else:
        print(f"native kernel not built ({cpu_kernels.UNAVAILABLE_REASON}): BLAS forms only")
    dtype = getattr(torch, args.dtype)
    layers = make_layers(0, dtype)
    head = (torch.randn(VOCAB, HIDDEN) * 0.02).to(dtype) if args.lm_head else None
    print(f"{LAYERS} layers of SmolLM2's shapes, {args.dtype}, {args.threads} threads; "
          "ms per step (median over rounds)")  # fmt: skip
    print("| rows | " + " | ".join(forms) + " |")
    print("|---" * (len(forms) + 1) + "|")
    speedups = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",") if r):
            for form in forms.values():
                step_time(form, layers, rows, 1, args.feature_major, head)  # warm-up
            times: dict[str, list[float]] = {name: [] for name in forms}
            for _ in range(args.rounds):
                for name, form in forms.items():
                    times[name].append(
                        step_time(form, layers, rows, args.steps, args.feature_major, head)
                    )
            cells = [f"{statistics.median(t) * 1e3:.1f}" for t in times.values()]
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
            base = times["x W^T"]
            speedups.append((rows, [statistics.median(b / t for b, t in zip(base, ts))
                                    for ts in times.values()]))  # fmt: skip
    print("\nspeedup over x W^T (median of per-round ratios)\n")
    print("| rows | " + " | ".join(forms) + " |")
    print("|---" * (len(forms) + 1) + "|")
    for rows, ratios in speedups:
        print(f"| {rows} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")


if __name__ == "__main__":
    main()
