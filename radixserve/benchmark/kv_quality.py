"""How much a KV pool's storage format changes the model's predictions, teacher-forced.

The measure llama.cpp uses for KV cache quantization (``llama-perplexity
--kl-divergence``), on this runtime: one fixed text is prefilled in chunks of ``chunk``
tokens, so every chunk attends over the K/V earlier chunks left in the pool (read back
in the pool's format) and its own. At every position the full next-token distribution
(the whole vocabulary, from the worker's logits; no top-k truncation) is compared with
the one a float32 pool gives on the same text: the mean KL divergence
``KL(P_float32 || P_format)`` and the share of positions whose most likely token is the
float32 pool's (top-1 agreement).

``teacher_forced_logits`` scores one text on one Engine; ``compare`` reduces two
runs to ``(mean KL, top-1 agreement, max KL)``. ``bench/kv_quality.py`` prints the
table for the KV dtypes; ``tests/test_engine_kv_quant.py`` checks their order on a tiny
model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixserve.worker import model_runner


@contextlib.contextmanager
def _captured_scores(rows: list[torch.Tensor], ids: list[torch.Tensor]) -> Iterator[None]:
    """While active, every prompt-token scoring the worker does also appends its logits
    rows (float32, [m, vocab]) and the token ids it scores to ``rows`` / ``ids``."""
    original = model_runner.token_logprobs

    def capture(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> Any:
        rows.append(logits.detach().to(torch.float32).cpu().clone())
        ids.append(token_ids.detach().cpu().clone())
        return original(logits, token_ids, k)

    model_runner.token_logprobs = capture
    try:
        yield
    finally:
        model_runner.token_logprobs = original


def teacher_forced_logits(engine: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """The logits [len(token_ids) - 1, vocab] (float32) of every next token of
    ``token_ids`` on ``engine``: row i predicts token i + 1 from tokens 0..i. The text
    is prefilled as the Engine's scheduler chunks it (``chunked_prefill_size``), with
    an empty cache, so every position past the first chunk reads pool pages.
    ValueError when the rows the worker scored are not exactly those of the text."""
    from radixserve.sampling_params import SamplingParams

    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(token_ids)}")
    engine.flush_cache()
    rows: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    sp = SamplingParams(max_tokens=0, prompt_logprobs=1, logprob_start_len=1)
    with _captured_scores(rows, ids):
        engine.generate([list(token_ids)], sp)
    if not rows:
        raise ValueError("the worker scored no prompt tokens")
    got = torch.cat(ids).tolist()
    if got != list(token_ids[1:]):
        raise ValueError(
            f"the worker scored {len(got)} tokens, not the text's {len(token_ids) - 1} in order"
        )
    return torch.cat(rows)


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float, float]:
    """``(mean KL(P_ref || P_other), top-1 agreement, max KL)`` over the rows of two
    logits tensors [n, vocab], computed in float64."""
    if reference.shape != other.shape:
        raise ValueError(f"logits shapes differ: {tuple(reference.shape)} vs {tuple(other.shape)}")
    kls = []
    agree = 0
    for lo in range(0, reference.shape[0], 256):  # bounded float64 temporaries
        ref = torch.log_softmax(reference[lo : lo + 256].double(), dim=-1)
        oth = torch.log_softmax(other[lo : lo + 256].double(), dim=-1)
        kls.append((ref.exp() * (ref - oth)).sum(-1))
        agree += int((ref.argmax(-1) == oth.argmax(-1)).sum())
    kl = torch.cat(kls)
    return float(kl.mean()), agree / reference.shape[0], float(kl.max())
