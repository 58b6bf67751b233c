"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Each request slot has a seed: its own, or one drawn from the worker's seeded
stream when the slot is added. The uniform number behind a token comes from
numpy's PCG64 seeded with (slot seed, the token's absolute position), and is
turned into a token by inverse CDF over the filtered distribution. So a seeded
request's tokens depend on its seed and its logits only: never on what else
shares the batch, nor on whether it was retracted and recomputed (a
retraction restarts the slot, but positions stay the same). Filters apply in the order temperature, top-k, top-p,
min-p (min-p relative to the most likely token after top-k).

The sampler never decides that a request is finished; the scheduler does.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.layers import cpu_kernels
from radixserve.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seeds = np.random.default_rng(seed)
        self._params: dict[int, SamplingParams] = {}
        self._slot_seeds: dict[int, int] = {}

    def add(self, slot: int, params: SamplingParams) -> None:
        """Start a slot's sampling state (replacing any earlier one)."""
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        self._params[slot] = params
        self._slot_seeds[slot] = seed

    def remove(self, slot: int) -> None:
        self._params.pop(slot, None)
        self._slot_seeds.pop(slot, None)

    def has(self, slot: int) -> bool:
        return slot in self._params

    def params(self, slot: int) -> SamplingParams:
        return self._params[slot]

    def sample(self, logits: torch.Tensor, slots: list[int], positions: list[int]) -> np.ndarray:
        """One token id per row of ``logits`` [N, vocab], row i sampled for ``slots[i]``
        as the token at absolute position ``positions[i]``."""
        if logits.shape[0] != len(slots) or len(positions) != len(slots):
            raise ValueError("one slot and one position per logits row are required")
        params = [self._params[s] for s in slots]
        if cpu_kernels.argmax_ok(logits):
            # The LM head's [vocab, rows] layout, float32 or bfloat16, read in that order.
            out = cpu_kernels.argmax(logits)
        elif logits.dtype in (torch.bfloat16, torch.float16):
            out = logits.float().argmax(dim=-1)  # the same values; torch's bf16 argmax is slower
        else:
            out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            picked = [params[i] for i in rows]
            uniforms = [
                float(np.random.default_rng((self._slot_seeds[slots[i]], positions[i])).random())
                for i in rows
            ]
            tokens = sample_filtered(logits[rows], picked, uniforms)
            out[torch.tensor(rows, device=out.device)] = tokens
        return out.to(torch.int32).cpu().numpy()

    def uniforms(self, slot: int, position: int, n: int = 1) -> list[float]:
        """The first ``n`` uniforms of ``slot``'s stream at ``position``: the first is
        the one ``sample`` uses for the token there."""
        rng = np.random.default_rng((self._slot_seeds[slot], position))
        return rng.random(n).tolist()


def _filtered_sorted(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After temperature / top-k / top-p / min-p: each row's probabilities sorted most
    likely first (dropped tokens 0), the token order, and the dropped mask."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    dev, vocab = logits.device, logits.shape[-1]

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)[:, None]

    scaled = logits.to(dtype) / col([p.temperature for p in params])
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    top_k = col([p.top_k if p.top_k > 0 else vocab for p in params])
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= col([p.top_p for p in params])
    drop |= probs < col([p.min_p for p in params]) * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return probs.masked_fill(drop, 0.0), order, drop


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution ``sample_filtered`` draws from, one row per request, in token
    order (float64 for float64 logits, else float32; not renormalised: the kept
    tokens' softmax mass)."""
    probs, order, _ = _filtered_sorted(logits, params)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def _unfiltered(p: SamplingParams, vocab: int) -> bool:
    """Temperature alone: no top-k, top-p or min-p cuts the distribution."""
    return (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0


def sample_filtered(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
) -> torch.Tensor:
    """Inverse-CDF sampling after temperature / top-k / top-p / min-p, one row per request.
    Rows that only have a temperature walk the CDF in token order (no sort of the
    vocabulary: the common case of a client's default parameters); rows with a filter
    walk it most likely first, as the filters need the order."""
    vocab = logits.shape[-1]
    plain = [i for i, p in enumerate(params) if _unfiltered(p, vocab)]
    if not plain:
        return _sample_sorted(logits, params, uniforms)
    if len(plain) == len(params):
        return _sample_plain(logits, params, uniforms)
    out = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    cut = [i for i, p in enumerate(params) if not _unfiltered(p, vocab)]
    for rows, fn in ((plain, _sample_plain), (cut, _sample_sorted)):
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = fn(logits[idx], [params[i] for i in rows], [uniforms[i] for i in rows])
    return out


def _sample_plain(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
) -> torch.Tensor:
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=dtype, device=dev)[:, None]
    cdf = (logits.to(dtype) / temps).softmax(dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.tensor(uniforms, dtype=dtype, device=dev)[:, None] * total
    choice = torch.searchsorted(cdf, target, right=True)
    # Never past the last token with mass (possible only through rounding at the top).
    last = (cdf < total).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)
    return torch.minimum(choice, last).squeeze(1)


def _sample_sorted(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
) -> torch.Tensor:
    probs, order, drop = _filtered_sorted(logits, params)
    dtype, dev, vocab = probs.dtype, logits.device, logits.shape[-1]

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)[:, None]

    cdf = probs.cumsum(dim=-1)
    target = col(uniforms) * cdf[:, -1:]
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # Never land on a dropped token (possible only through rounding at the top of the cdf).
    choice = torch.minimum(choice, (~drop).sum(dim=-1, keepdim=True) - 1)
    return order.gather(1, choice).squeeze(1)
