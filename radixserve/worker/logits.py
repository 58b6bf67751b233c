"""What happens to the logits between the model and the sampler: logprobs,
``min_tokens``, ``logit_bias`` and the penalties, batched over the step's rows.

Logprobs are the log-softmax of the raw logits (vLLM's default): taken before
anything below changes them, so asking for logprobs never changes a token.

Processing, in this order (rows of requests that ask for none are untouched):
1. ``min_tokens``: while fewer tokens than that were generated, the EOS ids
   (unless ``ignore_eos``) and ``stop_token_ids`` get -inf;
2. ``logit_bias``: each biased token's logit plus its bias;
3. ``repetition_penalty`` (HF transformers'): each token seen in the prompt or
   the output has its logit divided by the penalty when positive, multiplied
   when negative;
4. ``frequency_penalty`` times the token's count in the output, and
   ``presence_penalty`` once per token present in it, subtracted (OpenAI's).

Penalty state lives per slot and is kept incrementally: a count of each
generated token and a mask of tokens seen, built once from the history the
scheduler sends with the slot's sampling parameters (the prompt and whatever
the request generated before a retraction) and updated with each sampled
token. Nothing re-scans a history per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.sampling_params import SamplingParams


@dataclass
class _SlotState:
    params: SamplingParams
    prompt_len: int
    masked: torch.Tensor | None  # token ids masked until min_tokens were generated
    bias_ids: torch.Tensor | None
    bias: torch.Tensor | None
    counts: torch.Tensor | None  # [vocab] int32: each token's count in the output
    seen: torch.Tensor | None  # [vocab] bool: in the prompt or the output


class LogitsProcessor:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device):
        self.vocab_size = vocab_size
        self.eos = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.device = device
        self._slots: dict[int, _SlotState] = {}

    def add(self, slot: int, params: SamplingParams, prompt_len: int, history: np.ndarray) -> None:
        """Start (or restart) a slot's state. ``history``: the request's tokens so
        far, prompt first (required when ``params.penalized``)."""
        self._slots.pop(slot, None)
        if not params.processes_logits:
            return
        dev, vocab = self.device, self.vocab_size
        masked = bias_ids = bias = counts = seen = None
        if params.min_tokens > 0:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
            ids = sorted(t for t in ids if 0 <= t < vocab)
            masked = torch.tensor(ids, dtype=torch.int64, device=dev) if ids else None
        if params.logit_bias:
            pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
            bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=dev)
            bias = torch.tensor([b for _, b in pairs], dtype=torch.float64, device=dev)
        if params.penalized:
            if len(history) < prompt_len:
                raise ValueError(
                    f"slot {slot}: penalties need the request's history "
                    f"({len(history)} tokens given, prompt {prompt_len})"
                )
            hist = torch.from_numpy(np.asarray(history, dtype=np.int64)).to(dev)
            if len(hist) and (int(hist.min()) < 0 or int(hist.max()) >= vocab):
                raise ValueError(f"slot {slot}: history token id out of range [0, {vocab})")
            counts = torch.zeros(vocab, dtype=torch.int32, device=dev)
            counts.index_add_(
                0, hist[prompt_len:], torch.ones_like(hist[prompt_len:], dtype=torch.int32)
            )
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[hist] = True
        self._slots[slot] = _SlotState(params, prompt_len, masked, bias_ids, bias, counts, seen)

    def remove(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def active(self, slots: list[int]) -> bool:
        return any(s in self._slots for s in slots)

    def apply(self, logits: torch.Tensor, slots: list[int], positions: list[int]) -> torch.Tensor:
        """Process ``logits`` [N, vocab] in place: row i samples ``slots[i]``'s token
        at absolute position ``positions[i]``. Float32 or float64 logits."""
        rows = [i for i, s in enumerate(slots) if s in self._slots]
        if not rows:
            return logits
        states = [self._slots[slots[i]] for i in rows]
        neg_inf = float("-inf")
        for i, st in zip(rows, states):
            row = logits[i]
            if st.masked is not None and positions[i] - st.prompt_len < st.params.min_tokens:
                row.index_fill_(0, st.masked, neg_inf)
            if st.bias_ids is not None:
                row.index_add_(0, st.bias_ids, st.bias.to(row.dtype))
        pen = [(i, st) for i, st in zip(rows, states) if st.counts is not None]
        if pen:
            idx = torch.tensor([i for i, _ in pen], device=logits.device)
            sub = logits.index_select(0, idx)
            dtype = sub.dtype

            def col(values: list[float]) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype, device=logits.device)[:, None]

            seen = torch.stack([st.seen for _, st in pen])
            counts = torch.stack([st.counts for _, st in pen]).to(dtype)
            rep = col([st.params.repetition_penalty for _, st in pen])
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
            sub -= col([st.params.frequency_penalty for _, st in pen]) * counts
            sub -= col([st.params.presence_penalty for _, st in pen]) * (counts > 0).to(dtype)
            logits.index_copy_(0, idx, sub)
        return logits

    def record(
        self, slots: list[int], tokens: np.ndarray, forced: dict[int, list[int]] | None = None
    ) -> None:
        """Count the tokens just generated: ``tokens[i]`` for ``slots[i]``, or, for a
        slot in ``forced`` (jump-forward), the tokens that replace it."""
        for slot, token in zip(slots, tokens.tolist()):
            st = self._slots.get(slot)
            if st is None or st.counts is None:
                continue
            for t in forced.get(slot, (token,)) if forced else (token,):
                st.counts[t] += 1
                st.seen[t] = True


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log-softmax of ``logits`` [m, vocab] (in float64 when they are, else
    float32): each row's logprob of ``token_ids[i]`` and its top ``k`` (ids and
    logprobs, most likely first), as numpy arrays [m], [m, k], [m, k]."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lp = torch.log_softmax(logits.to(dtype), dim=-1)
    chosen = lp.gather(1, token_ids.to(torch.int64)[:, None]).squeeze(1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    return (
        chosen.double().cpu().numpy(),
        top_ids.to(torch.int32).cpu().numpy(),
        top_lp.double().cpu().numpy(),
    )
