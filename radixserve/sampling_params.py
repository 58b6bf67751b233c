"""Sampling parameters shared by the Engine, the client library and the worker.

Names follow OpenAI's API where one exists. The object is validated on
construction, so a bad value is rejected where it enters the system, with a
message naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion.

    temperature 0 means greedy. ``top_k`` <= 0 and ``top_p`` == 1 and
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
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not _is_int(self.n) or not 1 <= self.n <= 128:
            raise bad(f"n must be an integer in [1, 128], got {self.n!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"invalid sampling parameter: unknown field(s) {sorted(unknown)}")
        return cls(**d)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN
