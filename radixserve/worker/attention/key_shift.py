"""Shifted keys of fp8 KV pools: a constant per (layer, kv head) taken off every key.

Softmax cannot see a constant added to all of one query's scores, and
``q . (k - m) = q . k - q . m`` subtracts the same ``q . m`` from every score of a
query for one vector m per layer and kv head, so a pool may store ``k - m`` for every
key of that layer and head and attention reads it as the key, unchanged: the weights
are exactly those of the keys themselves (SageAttention's key smoothing). What changes
is the rounding. Post-rotary keys carry a large offset shared by all positions in a few
channels (the slow rotary frequencies barely turn it), which the Hadamard rotation
(``rotation.py``) spreads over the whole row: it sets the row's scale, and an fp8
code's error is relative to that. Taken off first, the row's scale fits what varies
from token to token.

m is the mean post-rotary key of each (layer, kv head) over a fixed calibration
sequence (``CALIBRATION_TEXT`` as the model's tokenizer encodes it, repeated to
``CALIBRATION_TOKENS`` positions) that the loaded model runs once at start through a
plain causal attention of its own (``_Probe``, no pool), before the attention backend
is built. It is stored rotated (m R, the basis the
pool holds keys in: ``(k - m) R = k R - m R``), rounded to bfloat16 values and kept in
float32 (float64 for a float64 model) as ``KVPool.key_shift`` [layers, kv_heads,
head_dim]; every path that writes keys subtracts it from the rotated float32 key row
right before quantizing: the backends' forward (``KeyRotation.rotate``) and the native
one-call decode layers (``csrc/decode_layers.cpp``), the same float32 subtraction, so
the same bits. Reads need nothing. A tensor-parallel rank calibrates its own heads (the
ranks run the calibration together, as they run every step).

Which pools: the fp8 formats (every layout), whose codes' error is relative to the
value: on ``bench/kv_quality.py``'s text the shift takes fp8_e4m3 from 3.04x to 2.62x
the bfloat16 pool's KL and fp8_e5m2 from 9.68x to 7.96x (bench/results/kv_quality.md).
Not int8 (within its goal already; its pools stay bitwise as they were), not plain
float pools. Not a
model whose attention is not shift-invariant: a soft-capped one (``tanh`` of the
scores, Gemma 2) or a hybrid one (the probe has no recurrent states to run its other
layers with).

**GPTQ factors** (``KVPool.key_gptq``, the ``row`` layout's fp8 pools: the CPU's). The
same pass takes each layer's rotated queries' second moment per kv head, H (over the kv
head's query heads and the calibration's tokens): a key row's rounding error e moves the
scores by q . e, whose mean square over those queries is e H e^T. ``gptq_factors`` damps
H (``DAMP``), inverts it and keeps the upper Cholesky factor U of H^-1 (rounded to
bfloat16 values, in float32), and every key write rounds the row GPTQ's way with its
kv head's U (``kv_quant.gptq_codes``; the native kernel's ``write_row_gptq``, the same
bits): the codes one value at a time, each one's error carried into the values after
it through U, so that the error lands where the queries look least. The scale is still
the searched one: only codes move, and a page means what it meant (a code times the
scale). On ``bench/kv_quality.py``'s text it takes fp8_e4m3 from 2.15x to 1.71x the
bfloat16 pool's KL (bench/results/kv_quality.md). The factors are named in the pool's
identity like the shift (``key_gptq=<digest>;``).

The shift is part of what the pool's pages mean: ``KVPool.key_tag`` names it by a
digest of its values, and that tag enters the identity the host, disk and store tiers
key pages by (``host_cache.kv_identity``) and the one a prefill/decode pair checks
(``kv_transfer.transfer_identity``): pages written with one shift are never read with
another. The calibration is deterministic for given weights, dtype, kv dtype and
device kind; a machine whose arithmetic differs (another ISA, a GPU) may round a mean
differently and then shares no pages with this one.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from radixserve.worker.attention.rotation import fwht, key_dtype
from radixserve.worker.kv_quant import fp8_row_layout

log = logging.getLogger("radixserve.worker")

#: The fixed sequence the key means are taken over: prose, code, a dialogue, a table,
#: numbers and JSON, so that the means are those of text in general, not of one kind.
CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in before dawn, and by seven the \
market on the quay was loud with prices, weather and gossip. Maria counted crates \
while her brother argued with a buyer from the city about the cost of diesel, the \
new rules on quotas, and whether the storm forecast for Thursday would keep the \
fleet in port for the rest of the week.

def moving_average(values, window=3):
    \"\"\"Return the running mean of values over the given window.\"\"\"
    if window < 1:
        raise ValueError("window must be positive")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out

Q: What is the capital of Australia, and why is it not Sydney?
A: Canberra. It was chosen in 1908 as a compromise between Sydney and Melbourne, \
the two largest cities, which both wanted to be the capital.

| year | revenue (M$) | growth |
|------|--------------|--------|
| 2021 | 12.4         | 8.1%   |
| 2022 | 13.9         | 12.1%  |
| 2023 | 15.2         | 9.4%   |

In physics, the energy of a photon is E = h * f, where h is Planck's constant \
(6.626e-34 J s) and f is the frequency. Light of wavelength 500 nm therefore \
carries about 4.0e-19 joules per photon.

{"id": 42, "name": "sensor-7", "readings": [3.14, 2.72, 1.41], "active": true}

Dear team, thank you all for the hard work this quarter. Please remember to submit \
your expense reports by Friday, and let me know if you have any questions about \
the new travel policy.
"""


#: How many positions the means are taken over: the text, repeated. A rotary pair that
#: turns by a radian or more over the span averages out of the mean, so the span decides
#: which channels the shift keeps; 2,048 positions is a typical prompt's context (with
#: the text once, 470 positions, SmolLM2's e4m3 pool measured 2.74x the bfloat16 pool's
#: KL over a 2,048-token text, against 2.62x: bench/results/kv_quality.md).
CALIBRATION_TOKENS = 2048


def calibration_ids(tokenizer: Any, max_context_len: int) -> list[int]:
    """``CALIBRATION_TEXT`` as ``tokenizer`` encodes it, repeated to
    ``CALIBRATION_TOKENS`` tokens, at most what a prompt may hold (the context keeps
    room for one output token)."""
    once = list(tokenizer.encode(CALIBRATION_TEXT))
    n = min(CALIBRATION_TOKENS, max_context_len - 1)
    return (once * -(-n // len(once)))[:n]


def applies(pool, cfg) -> bool:
    """Whether ``pool`` (a ``KVPool``) of a model of ``cfg`` stores shifted keys."""
    quant = pool.quant
    return (
        pool.rotated
        and quant is not None
        and quant.is_fp8
        and cfg.attn_softcap == 0
        and not cfg.hybrid
    )


class _Probe:
    """A ``LayerAttention`` without a pool: plain causal attention (each layer's
    sliding window too) over one sequence, in the model's dtype, summing every layer's
    keys per kv head in float64 on the way."""

    plans_native_steps = False  # never the one-call decode layers (decode_step.py)

    def __init__(self, scale: float, windows: tuple[int, ...]) -> None:
        self.scale = scale
        self.windows = windows
        self.sums: dict[int, torch.Tensor] = {}
        #: Each layer's rotated queries' second moment per kv head (over its query
        #: heads and the tokens), float64 [kv_heads, head_dim, head_dim].
        self.moments: dict[int, torch.Tensor] = {}

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.sums[layer] = k.to(torch.float64).sum(0)  # [kv_heads, head_dim]
        t, kv_heads = k.shape[0], k.shape[1]
        group = q.shape[1] // kv_heads
        qr = fwht(q.to(torch.float64)).view(t, kv_heads, group, -1).transpose(0, 1)
        qr = qr.reshape(kv_heads, t * group, -1)
        self.moments[layer] = qr.transpose(1, 2) @ qr / (t * group)
        i = torch.arange(t, device=q.device)
        keep = i[None, :] <= i[:, None]
        if self.windows[layer] > 0:
            keep &= i[:, None] - i[None, :] < self.windows[layer]
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        for h in range(kv_heads):  # one kv head's query heads at a time: [group, t, t] scores
            heads = slice(h * group, (h + 1) * group)
            kh, vh = (x[:, h].unsqueeze(0).expand(group, -1, -1) for x in (k, v))
            o = F.scaled_dot_product_attention(
                q[:, heads].transpose(0, 1), kh, vh, attn_mask=keep, scale=self.scale
            )
            out[:, heads] = o.transpose(0, 1)
        return out


@torch.inference_mode()
def key_statistics(
    model, token_ids: list[int]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Each layer's mean post-rotary key [kv_heads, head_dim] and its rotated queries'
    second moment per kv head [kv_heads, head_dim, head_dim] (float64) over
    ``token_ids`` run through ``model`` (a ``CausalLM``) in one pass, by the layer
    index its attention passes."""
    cfg = model.cfg
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    probe = _Probe(cfg.attention_scale, cfg.kv_sliding_windows)
    last = torch.tensor([len(token_ids) - 1], device=device)
    model(ids, positions, len(token_ids) - 1, probe, last)
    means = {layer: s / len(token_ids) for layer, s in probe.sums.items()}
    return means, probe.moments


#: GPTQ's damping: H + DAMP * mean(diag H) * I before it is inverted (0.01 measured
#: worse than 0.1 on SmolLM2's fp8_e4m3 keys, bench/results/kv_quality.md).
DAMP = 0.1


def gptq_factors(moments: list[torch.Tensor]) -> torch.Tensor:
    """The pool's ``key_gptq`` [layers, kv_heads, head_dim, head_dim] from its layers'
    query second moments (float64 [kv_heads, head_dim, head_dim]): each damped H's
    inverse's upper Cholesky factor U (H^-1 = U^T U, in float64), rounded to bfloat16
    values (so that a run whose sums round a last bit differently still gets the same
    factor, mostly), kept in float32: what ``kv_quant.quantize``'s ``gptq`` takes."""
    h = torch.stack(moments).to(torch.float64)
    d = h.shape[-1]
    diag = h.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True)[..., None]
    damped = h + DAMP * diag * torch.eye(d, dtype=torch.float64, device=h.device)
    u = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    return u.to(torch.bfloat16).to(torch.float32).contiguous()


def rotated_shift(means: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The pool's ``key_shift`` [layers, kv_heads, head_dim] from its layers' mean keys
    (float64): rotated (m R, in float64), rounded to bfloat16 values, kept in the
    dtype keys are rotated in for a model of ``dtype`` (``rotation.key_dtype``)."""
    m = fwht(torch.stack(means).to(torch.float64))
    return m.to(torch.bfloat16).to(key_dtype(dtype))


def digest(shift: torch.Tensor) -> str:
    """A short name of a shift's values (what pages written with it depend on)."""
    return hashlib.sha256(shift.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def calibrate(
    model, tokenizer: Callable[[], Any], pools: list[tuple[Any, tuple[int, ...]]]
) -> None:
    """Set ``key_shift`` (and, in the fp8 row layout, ``key_gptq``) on each pool of
    ``pools`` (a ``KVPool`` and the attention layers it holds, in its order) that
    ``applies``: from ``key_statistics`` over ``calibration_ids`` (``tokenizer()``: the
    model's tokenizer, loaded on call), one forward of ``model`` for all of them;
    nothing runs when no pool takes a shift.
    Every tensor-parallel rank calls it at the same point."""
    cfg = model.cfg
    todo = [(pool, layers) for pool, layers in pools if applies(pool, cfg)]
    if not todo:
        return
    ids = calibration_ids(tokenizer(), cfg.max_context_len)
    means, moments = key_statistics(model, ids)
    for pool, layers in todo:
        shift = rotated_shift([means[layer] for layer in layers], pool.dtype)
        pool.set_key_shift(shift)
        if fp8_row_layout(pool.quant):  # GPTQ-rounded keys too (the CPU's layout)
            pool.set_key_gptq(gptq_factors([moments[layer] for layer in layers]))
        log.info(
            "fp8 keys shifted by their mean over %d calibration tokens (%s)",
            len(ids), pool.key_tag.rstrip(";"),
        )  # fmt: skip
