"""Sampling parameters shared by the Engine, the client library and the worker.

Names follow OpenAI's API where one exists. The object is validated on
construction, so a bad value is rejected where it enters the system, with a
message naming the field.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

DEFAULT_MAX_TOKENS = 128
MAX_N = 128  # the most samples one request may ask for (a server may allow fewer)
INT64_MAX = 2**63 - 1  # integers travel as msgpack int64: nothing larger is accepted
TOKEN_ID_MAX = 2**31 - 1  # token ids travel as int32
# Temperatures below this sample greedily: dividing logits by a tiny temperature
# overflows to inf and NaN (vLLM uses the same bound).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion.

    temperature 0 (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k`` <= 0 and ``top_p`` == 1 and
    ``min_p`` == 0 disable those filters. ``seed`` makes a request's output a
    function of (seed, prompt) alone, whatever else shares its batch.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_worker(self) -> SamplingParams:
        """These parameters without what only the tokenizer and the scheduler use
        (stop strings, stop token ids), as they travel to the worker."""
        if not self.stop and not self.stop_token_ids:
            return self
        return replace(self, stop=(), stop_token_ids=())

    def validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise bad(
                f"max_tokens must be an integer >= 1 and below 2**63, got {short_repr(self.max_tokens)}"
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad(
                f"temperature must be a finite number >= 0, got {short_repr(self.temperature)}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {short_repr(self.top_p)}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad(f"top_k must be -1 or 0 (disabled) or >= 1, got {short_repr(self.top_k)}")
        if self.top_k > INT64_MAX:
            raise bad(f"top_k must be below 2**63, got {short_repr(self.top_k)}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {short_repr(self.min_p)}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer in [1, {MAX_N}], got {short_repr(self.n)}")
        # Sample i of n is seeded with seed + i: every one of them must be a valid seed.
        if self.seed is not None and (
            not _is_int(self.seed) or not 0 <= self.seed <= INT64_MAX - (self.n - 1)
        ):
            raise bad(f"seed must be an integer in [0, 2**63 - n], got {short_repr(self.seed)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and 0 <= t <= TOKEN_ID_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids must be token ids (integers in [0, 2**31))")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a boolean, got {short_repr(self.ignore_eos)}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            names = short_repr(sorted(map(str, unknown)))
            raise ValueError(f"invalid sampling parameter: unknown field(s) {names}")
        return cls(**d)


def short_repr(value: object, limit: int = 64) -> str:
    """``repr(value)``, cut to ``limit`` characters: errors never echo a large input."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN
