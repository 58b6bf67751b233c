"""Sampling parameters shared by the Engine, the client library and the worker.

Names follow OpenAI's API where one exists. The object is validated on
construction, so a bad value is rejected where it enters the system, with a
message naming the field.
"""

from __future__ import annotations

import hashlib
import json
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
MAX_LOGPROBS = 20  # the most alternatives per position (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 100.0  # biases are clamped to [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024  # token ids one request may bias
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_STRUCTURED_CHARS = 256 * 1024  # the longest schema / regex / grammar source accepted


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a completion (docs/structured.md): ``kind`` is one of
    ``json_schema`` (``spec``: the schema as JSON text), ``json_object`` (any
    JSON object; ``spec`` empty), ``regex`` (``spec``: the pattern, matched in
    full) or ``grammar`` (``spec``: EBNF in xgrammar's dialect, rule ``root``).

    Build one with the constructors: ``StructuredOutput.json(schema)``,
    ``.json_object()``, ``.regex(pattern)``, ``.grammar(ebnf)``. ``key`` names
    the compiled grammar in the worker's cache: equal sources share it.
    """

    kind: str
    spec: str = ""

    @classmethod
    def json(cls, schema: dict[str, Any] | bool | str) -> StructuredOutput:
        """A JSON schema (a mapping, a boolean, or its JSON text)."""
        if not isinstance(schema, str):
            try:
                schema = json.dumps(schema, separators=(",", ":"))
            except (TypeError, ValueError) as e:
                raise ValueError(f"invalid sampling parameter: json_schema: {e}") from None
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls("grammar", ebnf)

    @property
    def key(self) -> str:
        """A hash of the kind and the source: the compiled grammar's name."""
        digest = hashlib.sha256(f"{self.kind}\0{self.spec}".encode(errors="surrogatepass"))
        return digest.hexdigest()[:32]

    def validate(self) -> None:
        """The checks that need no grammar library: the kind, the source's type
        and size, and that a JSON schema is JSON (an object or a boolean)."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: structured: {msg}")

        if self.kind not in STRUCTURED_KINDS:
            raise bad(f"kind must be one of {STRUCTURED_KINDS}, got {short_repr(self.kind)}")
        if not isinstance(self.spec, str):
            raise bad(f"spec must be a string, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_STRUCTURED_CHARS:
            raise bad(
                f"the {self.kind} has {len(self.spec)} characters; at most "
                f"{MAX_STRUCTURED_CHARS} are allowed"
            )
        if self.kind == "json_object" and self.spec:
            raise bad("json_object takes no spec")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise bad(f"the {self.kind} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise bad(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad(
                    f"json_schema must be an object or a boolean, got {type(schema).__name__}"
                )

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "spec": self.spec}

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutput | None:
        """From a ``StructuredOutput``, None, or the map ``to_dict`` writes."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict) and set(value) <= {"kind", "spec"} and "kind" in value:
            return cls(value["kind"], value.get("spec", ""))
        raise ValueError(
            "invalid sampling parameter: structured must be null or a map "
            '{"kind": ..., "spec": ...}'
        )


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion.

    ``max_tokens=0`` only prefills: the prompt is computed (and cached, and
    scored with ``prompt_logprobs``), nothing is generated, and the request
    finishes with "length" (docs/scheduler.md). temperature 0 (or below
    ``GREEDY_TEMPERATURE``) means greedy. ``top_k`` <= 0 and ``top_p`` == 1 and
    ``min_p`` == 0 disable those filters. ``seed`` makes a request's output a
    function of (seed, prompt) alone, whatever else shares its batch.

    Logprobs (docs/sampling.md): ``logprobs=k`` returns, for each generated
    token, its log-probability and the ``k`` most likely alternatives;
    ``prompt_logprobs=k`` does the same for each prompt token from position
    ``logprob_start_len`` on (position 0 has none). Both are the log-softmax of
    the model's raw logits: before penalties, biases, temperature and filters.

    Logits processing, in this order, before temperature and the filters:
    ``min_tokens`` (EOS and ``stop_token_ids`` masked until that many tokens
    were generated), ``logit_bias`` (token id -> bias added, clamped to
    +-100), ``repetition_penalty`` (HF's: over prompt and generated tokens, a
    positive logit divided by it, a negative one multiplied), then
    ``frequency_penalty`` (times the token's count) and ``presence_penalty``
    (once per token present), OpenAI's, subtracted, over generated tokens.

    ``structured`` (a ``StructuredOutput``) constrains the completion to a JSON
    schema, any JSON object, a regex or an EBNF grammar: after the processing
    above, every token the grammar cannot take next is masked (docs/structured.md).

    Two scheduling fields travel with the rest (docs/scheduler.md, "Priorities"):
    ``priority`` (an integer, lower goes first, as vLLM's; it orders and preempts
    only under ``--schedule-policy priority``) and ``request_timeout`` (seconds
    from arrival at the scheduler: a request still unfinished then is ended with
    an error and its KV released; None: no limit; the client library's own
    ``timeout`` is how long the client waits, a different thing).
    ``cache_retention`` (``[level, seconds]``, level 1..100, higher kept longer)
    asks that the prompt's cached prefix outlive others' for that long under
    ``--radix-eviction-policy priority`` (ignored under the other policies).
    ``explain``: the result's usage also says what the prefix cache served of the
    prompt when the request arrived, and why no more (docs/cache-tiers.md, "Explain").
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
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, sorted by token id; a mapping is accepted too.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    structured: StructuredOutput | None = None
    priority: int = 0
    request_timeout: float | None = None
    cache_retention: tuple[int, float] | None = None
    explain: bool = False

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "structured", StructuredOutput.from_value(self.structured))
        if isinstance(self.cache_retention, list):
            object.__setattr__(self, "cache_retention", tuple(self.cache_retention))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the request's token history (worker side)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before temperature and the filters."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def for_worker(self) -> SamplingParams:
        """These parameters without what only the tokenizer and the scheduler use
        (stop strings; stop token ids unless ``min_tokens`` masks them), as they
        travel to the worker."""
        keep_ids = self.stop_token_ids if self.min_tokens > 0 else ()
        if not self.stop and keep_ids == self.stop_token_ids:
            return self
        return replace(self, stop=(), stop_token_ids=keep_ids)

    def validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if not _is_int(self.max_tokens) or not 0 <= self.max_tokens <= INT64_MAX:
            raise bad(
                f"max_tokens must be an integer >= 0 and below 2**63, got {short_repr(self.max_tokens)}"
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
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                f"min_tokens must be an integer in [0, max_tokens], got {short_repr(self.min_tokens)}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise bad(f"{name} must be in [-2, 2], got {short_repr(v)}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp < math.inf:
            raise bad(f"repetition_penalty must be a finite number > 0, got {short_repr(rp)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise bad(
                f"logit_bias has {len(self.logit_bias)} entries; at most "
                f"{MAX_LOGIT_BIAS_ENTRIES} are allowed"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(
                    f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {short_repr(v)}"
                )
        if not _is_int(self.logprob_start_len) or not 0 <= self.logprob_start_len <= INT64_MAX:
            raise bad(
                f"logprob_start_len must be an integer >= 0, got {short_repr(self.logprob_start_len)}"
            )
        if not _is_int(self.priority) or not -INT64_MAX <= self.priority <= INT64_MAX:
            raise bad(
                f"priority must be an integer (lower goes first), got {short_repr(self.priority)}"
            )
        t = self.request_timeout
        if t is not None and (not _is_number(t) or not 0 < t < math.inf):
            raise bad(
                f"request_timeout must be null or a number of seconds > 0, got {short_repr(t)}"
            )
        cr = self.cache_retention
        if cr is not None and not (
            isinstance(cr, tuple)
            and len(cr) == 2
            and _is_int(cr[0])
            and 1 <= cr[0] <= 100
            and _is_number(cr[1])
            and 0 < cr[1] < math.inf
        ):
            raise bad(
                "cache_retention must be null or [level, seconds] with level in [1, 100] "
                f"and seconds > 0, got {short_repr(cr)}"
            )
        if not isinstance(self.explain, bool):
            raise bad(f"explain must be true or false, got {short_repr(self.explain)}")
        if self.structured is not None:
            self.structured.validate()
            if self.max_tokens == 0:
                raise bad("structured output needs max_tokens >= 1 (max_tokens 0 only prefills)")
        if self.max_tokens == 0 and self.logprobs is not None:
            raise bad("logprobs are for generated tokens; max_tokens 0 generates none")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        d["structured"] = None if self.structured is None else self.structured.to_dict()
        d["cache_retention"] = None if self.cache_retention is None else list(self.cache_retention)
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


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, biases clamped to +-100.

    Takes a mapping (token ids as ints or decimal strings, as JSON carries them)
    or a sequence of pairs; anything else is a ValueError naming the field."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"invalid sampling parameter: logit_bias {msg}")

    if not bias:
        return ()
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in bias
    ):
        items = list(bias)
    else:
        raise bad("must map token ids to biases")
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"has {len(items)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out: dict[int, float] = {}
    for key, value in items:
        tid = key
        if isinstance(key, str) and key.isdigit() and len(key) <= 10:
            tid = int(key)
        if not _is_int(tid) or not 0 <= tid <= TOKEN_ID_MAX:
            raise bad(f"keys must be token ids (integers in [0, 2**31)), got {short_repr(key)}")
        if not _is_number(value) or not math.isfinite(value):
            raise bad(f"values must be finite numbers, got {short_repr(value)}")
        out[tid] = float(min(max(value, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS))
    return tuple(sorted(out.items()))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN
