"""Where fp8 KV error comes from: quantizer variants on SmolLM2, outside the runtime.

The embedded SmolLM2 in transformers (float32), the same fixed text as
``bench/kv_quality.py``, one teacher-forced pass; its attention function rounds K and V
through a variant before attending (as a pool that stored them would), and each
position's full next-token distribution is compared with the unrounded model's (mean
KL, top-1 agreement). Variants: bfloat16; the pool's formats (``kv_quant.quantize``,
a scale per token and head); e4m3 on K only or V only; scales per 16-element block
instead of per row; e4m3 with each row's scale searched (the scales that put one of
the row's ``--top`` largest magnitudes on one of e4m3's top codes, keeping the one of
least squared error); keys "smoothed": less the mean post-RoPE key per (layer, kv
head, channel) of the ``--calibrate`` tokens that follow the measured ones (softmax
cannot see a vector subtracted from every key: q.(k - m) = q.k - q.m, a constant per
query row), or less the measured keys' own mean (the best a fixed vector does); keys
in int8 with values in e4m3; keys (and values) "rotated": rounded as ``x R`` for an
orthogonal R of order head_dim (the normalized Walsh-Hadamard matrix, or a fixed random
orthogonal one) and rotated back, which is what attention computes when the pool stores
``k R`` and queries are rotated too (``(q R).(k R) = q.k``; for values the output is
rotated back), alone or with 16-value blocks, smoothing or a searched scale. Nothing
here is a pool format: it measures what a format change would buy before one is built.
``--only "a;b"`` runs those variants (and bfloat16) alone.

    python bench/kv_quality_variants.py --tokens 2048
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from radixserve.worker.kv_quant import QUANTS, dequantize, quantize  # noqa: E402

E4M3_TOP_CODES = (448.0, 416.0, 384.0, 352.0, 320.0, 288.0, 256.0, 240.0, 224.0)


def round_trip(x: torch.Tensor, name: str, block: int = 0) -> torch.Tensor:
    """x as a pool of ``name`` holds it; ``block`` > 0: a scale per that many values."""
    q = QUANTS[name]
    if block:
        y = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
        return dequantize(quantize(y, q), q, x.dtype).reshape(x.shape)
    return dequantize(quantize(x, q), q, x.dtype)


def searched_e4m3(x: torch.Tensor, top: int) -> torch.Tensor:
    """e4m3 codes of each row under the candidate scale of least squared error."""
    xf = x.float()
    mags = xf.abs().topk(top, dim=-1).values
    cands = (mags[..., :, None] / torch.tensor(E4M3_TOP_CODES)).flatten(-2).clamp_min(1e-30)
    y = (xf[..., None, :] / cands[..., :, None]).clamp(-448, 448)
    y = y.to(torch.float8_e4m3fn).float() * cands[..., :, None]
    best = (y - xf[..., None, :]).pow(2).sum(-1).argmin(-1)
    idx = best[..., None, None].expand(*best.shape, 1, xf.shape[-1])
    return torch.gather(y, -2, idx).squeeze(-2).to(x.dtype)


def hadamard(n: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix of order n (a power of 2), float64: orthogonal,
    every entry +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Walsh-Hadamard matrix needs a power of 2, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A fixed random orthogonal matrix of order n (Q of a Gaussian matrix's QR), float64."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@functools.cache
def rotation(kind: str, head_dim: int) -> torch.Tensor:
    """``hadamard`` or ``random`` (orthogonal), of order head_dim."""
    return hadamard(head_dim) if kind == "hadamard" else random_orthogonal(head_dim)


def rotated(x: torch.Tensor, rot: torch.Tensor, f) -> torch.Tensor:
    """x rotated by ``rot``, rounded by ``f`` and rotated back: what attention computes
    when the pool stores x R and the query is rotated too, (q R).f(x R) = q.(f(x R) R^T),
    or, for values, when the output is rotated back."""
    r = rot.to(x.dtype)
    return f(x @ r) @ r.T


def smoothed(k: torch.Tensor, means: torch.Tensor | None, name: str) -> torch.Tensor:
    """k rounded as ``name`` after subtracting the calibrated per-(head, channel) mean.

    The mean is not added back: q.(k - m) differs from q.k by one constant per query
    row, which softmax ignores, so attention reads exactly what a pool of k - m gives.
    """
    if means is None:
        raise RuntimeError("smoothed variants need the calibration pass first")
    return round_trip(k - means.to(k.dtype)[None, :, None, :], name)


def variants(top: int, means: dict) -> dict:
    def smooth(name: str, values: str | None):
        def f(k, v, layer):
            vv = v if values is None else round_trip(v, values)
            return smoothed(k, means.get(layer), name), vv

        return f

    plain = {
        "bfloat16": lambda k, v: (k.bfloat16().to(k.dtype), v.bfloat16().to(v.dtype)),
        "int8": lambda k, v: (round_trip(k, "int8"), round_trip(v, "int8")),
        "int8, 16-value blocks": lambda k, v: (
            round_trip(k, "int8", 16),
            round_trip(v, "int8", 16),
        ),  # fmt: skip
        "fp8_e4m3": lambda k, v: (round_trip(k, "fp8_e4m3"), round_trip(v, "fp8_e4m3")),
        "fp8_e4m3, K only": lambda k, v: (round_trip(k, "fp8_e4m3"), v),
        "fp8_e4m3, V only": lambda k, v: (k, round_trip(v, "fp8_e4m3")),
        "fp8_e4m3, 16-value blocks": lambda k, v: (
            round_trip(k, "fp8_e4m3", 16),
            round_trip(v, "fp8_e4m3", 16),
        ),  # fmt: skip
        "fp8_e4m3, searched scale": lambda k, v: (searched_e4m3(k, top), searched_e4m3(v, top)),
        "fp8_e5m2": lambda k, v: (round_trip(k, "fp8_e5m2"), round_trip(v, "fp8_e5m2")),
    }

    def ignore_layer(f):
        return lambda k, v, layer: f(k, v)

    table = {n: ignore_layer(f) for n, f in plain.items()}
    table["int8, K smoothed"] = smooth("int8", "int8")
    table["fp8_e4m3, K smoothed"] = smooth("fp8_e4m3", "fp8_e4m3")
    table["fp8_e4m3, K smoothed, K only"] = smooth("fp8_e4m3", None)
    table["fp8_e5m2, K smoothed"] = smooth("fp8_e5m2", "fp8_e5m2")
    table["fp8_e4m3, K smoothed, 16-value blocks"] = lambda k, v, layer: (
        round_trip(k - means[layer].to(k.dtype)[None, :, None, :], "fp8_e4m3", 16),
        round_trip(v, "fp8_e4m3", 16),
    )  # fmt: skip
    table["K int8, V fp8_e4m3"] = lambda k, v, layer: (
        round_trip(k, "int8"),
        round_trip(v, "fp8_e4m3"),
    )  # fmt: skip

    def rotate(name: str, values: bool, kind: str = "hadamard", block: int = 0,
               smooth_k: bool = False, search: bool = False):  # fmt: skip
        def f(k, v, layer):
            r = rotation(kind, k.shape[-1])
            if smooth_k:
                k = k - means[layer].to(k.dtype)[None, :, None, :]

            def fk(x):
                return searched_e4m3(x, top) if search else round_trip(x, name, block)

            def fv(x):
                return round_trip(x, name, block)

            return rotated(k, r, fk), rotated(v, r, fv) if values else fv(v)

        return f

    table["fp8_e4m3, K rotated"] = rotate("fp8_e4m3", False)
    table["fp8_e4m3, K and V rotated"] = rotate("fp8_e4m3", True)
    table["fp8_e4m3, K rotated (random orthogonal)"] = rotate("fp8_e4m3", False, "random")
    table["fp8_e4m3, K and V rotated (random orthogonal)"] = rotate("fp8_e4m3", True, "random")
    table["fp8_e4m3, K rotated, 16-value blocks"] = rotate("fp8_e4m3", False, block=16)
    table["fp8_e4m3, K and V rotated, 16-value blocks"] = rotate("fp8_e4m3", True, block=16)
    table["fp8_e4m3, K smoothed and rotated"] = rotate("fp8_e4m3", False, smooth_k=True)
    table["fp8_e4m3, K rotated, searched scale"] = rotate("fp8_e4m3", False, search=True)
    table["int8, K rotated"] = rotate("int8", False)
    table["int8, K and V rotated"] = rotate("int8", True)
    table["fp8_e5m2, K and V rotated"] = rotate("fp8_e5m2", True)
    table["fp8_e4m3, K less its own mean"] = lambda k, v, layer: (
        round_trip(k - k.mean(2, keepdim=True), "fp8_e4m3"),
        round_trip(v, "fp8_e4m3"),
    )  # fmt: skip
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--top", type=int, default=4, help="magnitudes the scale search tries")
    ap.add_argument(
        "--calibrate", type=int, default=256,
        help="tokens after the measured ones whose mean key smooths the K variants",
    )  # fmt: skip
    ap.add_argument("--only", default="", help="variants separated by ; (bfloat16 always)")
    args = ap.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from bench.kv_quality import fixed_text
    from radixserve.models.embedded import ensure_smollm2
    from radixserve.models.tokenizer import load_tokenizer

    folder = ensure_smollm2()  # the embedded model as a transformers folder
    all_ids = load_tokenizer("smollm2").encode(fixed_text())
    ids = all_ids[: args.tokens]
    calib = all_ids[args.tokens : args.tokens + args.calibrate]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    means: dict = {}
    table = variants(args.top, means)
    if args.only:
        keep = {"bfloat16", *args.only.split(";")}
        table = {n: f for n, f in table.items() if n in keep}
    current = {"name": None}

    def attention(module, query, key, value, attention_mask, **kw):
        if current["name"] == "calibrate":
            means[module.layer_idx] = key[0].mean(1)  # (kv heads, head_dim), post-RoPE
        elif current["name"] is not None:
            key, value = table[current["name"]](key, value, module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kv_variant", attention)
    model.set_attn_implementation("kv_variant")
    x = torch.tensor([ids])
    with torch.no_grad():
        current["name"] = "calibrate"
        model(torch.tensor([calib]))
        current["name"] = None
        ref = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
        rows = []
        for name in table:
            t = time.perf_counter()
            current["name"] = name
            lp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
            kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
            top1 = (ref.argmax(-1) == lp.argmax(-1)).double().mean().item()
            rows.append((name, kl, top1))
            print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(f"SmolLM2 in transformers, float32, {len(ids)} tokens, one pass; KL against "
          f"unrounded K/V; {torch.get_num_threads()} threads; keys smoothed by the mean "
          f"of {len(calib)} other tokens")  # fmt: skip
    print("| K/V rounded as | KL mean | KL / bfloat16's | top-1 agreement |")
    print("|---|---|---|---|")
    for name, kl, top1 in rows:
        print(f"| {name} | {kl:.6f} | {kl / base:.1f}x | {top1:.2%} |")


if __name__ == "__main__":
    main()
