"""Every message radixserve sends over a socket, and the only place they are defined.

A message is a msgpack map ``{"type": ..., "v": PROTOCOL_VERSION, **fields}``;
never pickle. Each message is a dataclass whose fields carry a ``Kind``: how
to check a decoded value (and convert it, e.g. int32 bytes to a numpy array)
and how to encode it. ``decode(data, allowed)`` rejects malformed msgpack,
unknown or disallowed types, a wrong version, missing, unknown and wrong-typed
fields with a ``ProtocolError`` that names the problem (and the request id,
when one could be read, so the error reaches the right request).

Channels (see docs/protocol.md):
- public, client DEALER <-> tokenizer ROUTER: ``PUBLIC_REQUESTS`` in,
  ``Chunk`` / ``ResultMsg`` / ``Error`` / ``Reply`` out;
- tokenizer -> scheduler: ``AddRequest``, ``AbortRequest``, ``Flush``, ``GetStats``,
  ``CheckIdle``; scheduler -> tokenizer: ``Outputs``, ``RequestError``, ``AdminReply``;
- scheduler -> worker: ``Step``; worker -> scheduler: ``StepResult``;
- children -> launcher: ``Ready``; launcher -> tokenizer and HTTP front: ``Shutdown``;
  HTTP front -> launcher: ``Draining``.
Internal token and page id arrays travel as little-endian int32 bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from radixserve.sampling_params import SamplingParams, short_repr

PROTOCOL_VERSION = 1
MAX_ID_LEN = 256
# An error message never echoes more than this of the input that caused it.
MAX_ERROR_CHARS = 1024
# How an error for a client over its limit of requests in flight begins (the HTTP
# front answers it with 429).
TOO_MANY_IN_FLIGHT = "too many requests in flight"
# How an error begins when the server, not the request, is at fault (a hung worker,
# a grammar that rejected its own sampled token): the HTTP front answers it with 500.
SERVER_FAILED = "the server failed"
# Liveness of the public channel: ZeroMQ heartbeats (ZMTP PING/PONG, answered by
# libzmq's I/O threads, so a busy process still answers; a stopped or hung one
# does not). Both sides ping every HEARTBEAT_IVL_MS and drop a connection whose
# peer has not answered in HEARTBEAT_TIMEOUT_MS; a client's pings also ask the
# server to drop it after HEARTBEAT_TTL_MS of silence.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
HEARTBEAT_TTL_MS = 10000
FINISH_REASONS = ("stop", "length", "abort", "error")


class ProtocolError(ValueError):
    """A message that cannot be accepted. ``request_id`` is set when it could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


# ------------------------------------------------------------------ field kinds
@dataclass(frozen=True)
class Kind:
    """How one field is checked (and converted) at decode, and encoded."""

    what: str  # for error messages: "a string", "a list of integers", ...
    check: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda x: x
    encode: Callable[[Any], Any] = lambda x: x


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_id(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_ID_LEN


def _i32(x: Any) -> np.ndarray:
    return np.frombuffer(x, dtype="<i4").astype(np.int32, copy=False)


def _i32_bytes(x: Any) -> bytes:
    return np.asarray(x, dtype="<i4").tobytes()


def _optional(kind: Kind) -> Kind:
    return Kind(
        f"{kind.what} or null",
        lambda x: x is None or kind.check(x),
        lambda x: None if x is None else kind.convert(x),
        lambda x: None if x is None else kind.encode(x),
    )


def _sampling(x: Any) -> SamplingParams:
    try:
        return SamplingParams.from_dict(dict(x))
    except TypeError as e:  # a wrong-typed value SamplingParams could not even compare
        raise ValueError(f"invalid sampling parameter: {e}") from None


def _nested(cls: type[Message]) -> Kind:
    return Kind(
        f"a list of {cls.__name__} maps",
        lambda x: isinstance(x, list) and all(isinstance(i, dict) for i in x),
        lambda x: [cls._from_map(i, None) for i in x],
        lambda x: [i._to_map() for i in x],
    )


ID = Kind("a non-empty string (at most 256 characters)", _is_id)
STR = Kind("a string", lambda x: isinstance(x, str))
INT = Kind("an integer", _is_int)
BOOL = Kind("a boolean", lambda x: isinstance(x, bool))
MAP = Kind("a map", lambda x: isinstance(x, dict))
INT_LIST = Kind("a list of integers", lambda x: isinstance(x, list) and all(map(_is_int, x)))
STR_LIST = Kind(
    "a list of strings", lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x)
)
MAP_LIST = Kind(
    "a list of maps", lambda x: isinstance(x, list) and all(isinstance(i, dict) for i in x)
)
I32 = Kind(
    "int32 little-endian bytes",
    lambda x: isinstance(x, bytes) and len(x) % 4 == 0,
    _i32,
    _i32_bytes,
)
KEY_BYTES = 32  # one page's key: a SHA-256 digest (radixserve.scheduler.kv_events)
KEYS = Kind("concatenated 32-byte keys", lambda x: isinstance(x, bytes) and len(x) % KEY_BYTES == 0)
KEY = Kind("a 32-byte key", lambda x: isinstance(x, bytes) and len(x) == KEY_BYTES)
# The same bytes as a list: the few token ids of one output, read as Python ints.
I32_LIST = Kind(I32.what, I32.check, lambda x: _i32(x).tolist(), _i32_bytes)
F64 = Kind(
    "float64 little-endian bytes",
    lambda x: isinstance(x, bytes) and len(x) % 8 == 0,
    lambda x: np.frombuffer(x, dtype="<f8").astype(np.float64, copy=False),
    lambda x: np.asarray(x, dtype="<f8").tobytes(),
)


def _is_float(x: Any) -> bool:
    return isinstance(x, float) or _is_int(x)


def _is_scored(x: Any) -> bool:
    """One position's logprobs inside the server: [logprob, [top ids], [top logprobs]]."""
    return (
        isinstance(x, list)
        and len(x) == 3
        and _is_float(x[0])
        and isinstance(x[1], list)
        and isinstance(x[2], list)
        and len(x[1]) == len(x[2])
        and all(map(_is_int, x[1]))
        and all(map(_is_float, x[2]))
    )


def _is_public_scored(x: Any) -> bool:
    """One position's logprobs for a client: [token id, text, logprob, [[id, text, logprob], ...]]
    (a prompt position not scored: [token id, text, null, []])."""
    return (
        isinstance(x, list)
        and len(x) == 4
        and _is_int(x[0])
        and isinstance(x[1], str)
        and (_is_float(x[2]) or (x[2] is None and x[3] == []))
        and isinstance(x[3], list)
        and all(
            isinstance(t, list)
            and len(t) == 3
            and _is_int(t[0])
            and isinstance(t[1], str)
            and _is_float(t[2])
            for t in x[3]
        )
    )


def _scored_list(entry: Callable[[Any], bool], what: str) -> Kind:
    return _optional(
        Kind(
            f"a list of {what} (or null entries)",
            lambda x: isinstance(x, list) and all(e is None or entry(e) for e in x),
        )
    )


SCORED = _scored_list(_is_scored, "[logprob, top ids, top logprobs]")
PUBLIC_SCORED = _scored_list(_is_public_scored, "[token id, text, logprob, top]")
SAMPLING = Kind(
    "a map of sampling parameters", lambda x: isinstance(x, dict), _sampling, SamplingParams.to_dict
)
FINISH = _optional(Kind(f"one of {FINISH_REASONS}", lambda x: x in FINISH_REASONS))


def f(kind: Kind, default: Any = dataclasses.MISSING) -> Any:
    """A message field of ``kind``; with ``default`` it may be left out."""
    if isinstance(default, (list, dict, np.ndarray)):
        return field(default_factory=lambda: default.copy(), metadata={"kind": kind})
    return field(default=default, metadata={"kind": kind})


# --------------------------------------------------------------------- messages
_REGISTRY: dict[str, type[Message]] = {}


class Message:
    """Base of every message: ``encode()`` to msgpack bytes, ``decode()`` back."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            _REGISTRY[cls.TYPE] = cls

    def _to_map(self) -> dict[str, Any]:
        out = {}
        for fl in dataclasses.fields(self):  # type: ignore[arg-type]
            out[fl.name] = fl.metadata["kind"].encode(getattr(self, fl.name))
        return out

    def encode(self) -> bytes:
        return msgpack.packb({"type": self.TYPE, "v": PROTOCOL_VERSION, **self._to_map()})

    @classmethod
    def _from_map(cls, m: Mapping[str, Any], request_id: str | None) -> Any:
        fields = {fl.name: fl for fl in dataclasses.fields(cls)}  # type: ignore[arg-type]
        label = cls.TYPE or cls.__name__
        unknown = sorted(map(str, set(m) - set(fields)))
        if unknown:
            raise ProtocolError(f"{label}: unknown field(s) {short_repr(unknown)}", request_id)
        values = {}
        for name, fl in fields.items():
            kind: Kind = fl.metadata["kind"]
            if name not in m:
                if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
                    raise ProtocolError(f"{label}: missing field {name!r}", request_id)
                continue
            value = m[name]
            if not kind.check(value):
                raise ProtocolError(
                    f"{label}: field {name!r} must be {kind.what}, got {type(value).__name__}",
                    request_id,
                )
            try:
                values[name] = kind.convert(value)
            except ValueError as e:
                raise ProtocolError(str(e), request_id) from None
        return cls(**values)


def decode(data: bytes, allowed: Mapping[str, type[Message]] | None = None) -> Any:
    """Parse and validate one message; ``allowed`` limits the accepted types."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types on garbage
        raise ProtocolError("malformed message: not valid msgpack") from None
    if not isinstance(m, dict):
        raise ProtocolError("a message must be a msgpack map")
    rid = m.get("id") if _is_id(m.get("id")) else None
    m = dict(m)
    mtype, version = m.pop("type", None), m.pop("v", None)
    registry = _REGISTRY if allowed is None else allowed
    if not isinstance(mtype, str) or mtype not in registry:
        raise ProtocolError(f"unknown message type {short_repr(mtype)}", rid)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {short_repr(version)} "
            f"(this server speaks {PROTOCOL_VERSION})",
            rid,
        )
    return registry[mtype]._from_map(m, rid)


# ------------------------------------------------------------ public: requests
@dataclass
class Generate(Message):
    """Generate for one prompt: exactly one of prompt, input_ids, messages (and, with
    messages, the tools their chat template is given)."""

    TYPE: ClassVar[str] = "generate"
    id: str = f(ID)
    prompt: str | None = f(_optional(STR), None)
    input_ids: list[int] | None = f(_optional(INT_LIST), None)
    messages: list[dict] | None = f(_optional(MAP_LIST), None)
    # Tool definitions the chat template renders (with messages only).
    tools: list[dict] | None = f(_optional(MAP_LIST), None)
    sampling: SamplingParams = f(SAMPLING, SamplingParams())
    stream: bool = f(BOOL, False)
    cache_salt: str | None = f(_optional(STR), None)
    # Send the prompt back as text (each sample's first chunk, or its result).
    echo: bool = f(BOOL, False)


@dataclass
class Abort(Message):
    """Abort the sender's request ``id`` (no reply; the request ends with "abort")."""

    TYPE: ClassVar[str] = "abort"
    id: str = f(ID)


@dataclass
class FlushCache(Message):
    """Evict every unlocked cached page (with cache tiers: empty the host tier, and the
    disk tier unless ``keep_disk``). ``admin_key``: the server's admin API key, which
    it must bring when the server has one (else it is refused with an ``Error``)."""

    TYPE: ClassVar[str] = "flush_cache"
    id: str = f(ID)
    admin_key: str | None = f(_optional(STR), None)
    keep_disk: bool = f(BOOL, False)


@dataclass
class Stats(Message):
    TYPE: ClassVar[str] = "stats"
    id: str = f(ID)


@dataclass
class Health(Message):
    TYPE: ClassVar[str] = "health"
    id: str = f(ID)


@dataclass
class Check(Message):
    """Run the scheduler's idle-invariant check (tests and debugging); ``admin_key`` as
    for ``FlushCache``."""

    TYPE: ClassVar[str] = "check"
    id: str = f(ID)
    admin_key: str | None = f(_optional(STR), None)


@dataclass
class Tokenize(Message):
    """The token ids of one text or chat (exactly one of prompt, messages), as a
    ``generate`` with it would compute them, answered with ``Reply(id, {"input_ids"})``
    by the tokenizer process alone. ``add_special_tokens``: the tokenizer's own (BOS)
    around a text; ``add_generation_prompt``: the template's assistant opening after
    the messages."""

    TYPE: ClassVar[str] = "tokenize"
    id: str = f(ID)
    prompt: str | None = f(_optional(STR), None)
    messages: list[dict] | None = f(_optional(MAP_LIST), None)
    add_special_tokens: bool = f(BOOL, True)
    add_generation_prompt: bool = f(BOOL, True)


@dataclass
class Detokenize(Message):
    """The text of token ids, answered with ``Reply(id, {"text"})`` by the tokenizer
    process alone (ids outside the vocabulary are an error); ``skip_special_tokens``
    leaves special tokens' text out, as generated text does."""

    TYPE: ClassVar[str] = "detokenize"
    id: str = f(ID)
    token_ids: list[int] = f(INT_LIST)
    skip_special_tokens: bool = f(BOOL, True)


PUBLIC_REQUESTS: dict[str, type[Message]] = {
    c.TYPE: c for c in (Generate, Abort, FlushCache, Stats, Health, Check, Tokenize, Detokenize)
}


# ------------------------------------------------------------- public: replies
@dataclass
class Chunk(Message):
    """A streamed delta of sample ``index``; the last one has finish_reason and usage."""

    TYPE: ClassVar[str] = "chunk"
    id: str = f(ID)
    index: int = f(INT)
    text: str = f(STR)
    token_ids: list[int] = f(INT_LIST)
    finish_reason: str | None = f(FINISH, None)
    usage: dict | None = f(_optional(MAP), None)
    # One entry per token of token_ids, when logprobs were asked for.
    logprobs: list | None = f(PUBLIC_SCORED, None)
    # Every prompt position (logprob null where not scored): in the sample's first chunk.
    prompt_logprobs: list | None = f(PUBLIC_SCORED, None)
    # With echo: the prompt as text, in the sample's first chunk.
    prompt_text: str | None = f(_optional(STR), None)


@dataclass
class ResultMsg(Message):
    """A finished sample of a non-streaming request (n of them when n > 1)."""

    TYPE: ClassVar[str] = "result"
    id: str = f(ID)
    index: int = f(INT)
    text: str = f(STR)
    token_ids: list[int] = f(INT_LIST)
    finish_reason: str = f(FINISH)
    usage: dict = f(MAP)
    logprobs: list | None = f(PUBLIC_SCORED, None)
    prompt_logprobs: list | None = f(PUBLIC_SCORED, None)
    prompt_text: str | None = f(_optional(STR), None)


@dataclass
class Error(Message):
    """The request ``id`` failed (or, with id null, a message that had no readable id)."""

    TYPE: ClassVar[str] = "error"
    id: str | None = f(_optional(ID))
    message: str = f(STR)


@dataclass
class Reply(Message):
    """The answer to flush_cache / stats / health / check / tokenize ``id``."""

    TYPE: ClassVar[str] = "reply"
    id: str = f(ID)
    data: dict = f(MAP)


PUBLIC_REPLIES: dict[str, type[Message]] = {c.TYPE: c for c in (Chunk, ResultMsg, Error, Reply)}


# ------------------------------------------------------- tokenizer <-> scheduler
@dataclass
class AddRequest(Message):
    TYPE: ClassVar[str] = "add_request"
    rid: str = f(STR)
    input_ids: np.ndarray = f(I32)
    sampling: SamplingParams = f(SAMPLING)
    salt: str | None = f(_optional(STR), None)


@dataclass
class AbortRequest(Message):
    """Finish ``rid`` now; reason "stop" when the tokenizer saw a stop string."""

    TYPE: ClassVar[str] = "abort_request"
    rid: str = f(STR)
    reason: str = f(Kind('"abort" or "stop"', lambda x: x in ("abort", "stop")), "abort")
    index: int | None = f(_optional(INT), None)


@dataclass
class Flush(Message):
    TYPE: ClassVar[str] = "flush"
    tag: int = f(INT)
    keep_disk: bool = f(BOOL, False)


@dataclass
class GetStats(Message):
    TYPE: ClassVar[str] = "get_stats"
    tag: int = f(INT)


@dataclass
class CheckIdle(Message):
    TYPE: ClassVar[str] = "check_idle"
    tag: int = f(INT)


@dataclass
class OutputItem(Message):
    """What one step (or an abort) produced for one sample of a request.

    ``index`` says which of the request's n samples; ``token_ids`` are the new
    tokens (none for an abort); ``finish_reason`` is None while it runs.
    ``logprobs``: one ``[logprob, top ids, top logprobs]`` per token of
    ``token_ids`` when the request asked for them. ``prompt_logprobs``: one
    entry per prompt position (null where not scored), once, with the first
    token of sample 0. ``token_ids`` may hold several tokens: those a grammar
    forced after the sampled one (jump-forward, docs/structured.md).
    """

    rid: str = f(STR)
    index: int = f(INT)
    token_ids: list[int] = f(I32_LIST)
    finish_reason: str | None = f(FINISH)
    prompt_tokens: int = f(INT)
    completion_tokens: int = f(INT)
    cached_tokens: int = f(INT)
    logprobs: list | None = f(SCORED, None)
    prompt_logprobs: list | None = f(SCORED, None)
    # With finish_reason "error": what went wrong (every sample of the request fails).
    error: str | None = f(_optional(STR), None)
    # cached_tokens split by where they were found: [pool (L1), host (L2), disk (L3)].
    cached_tokens_by_tier: list[int] = f(INT_LIST, [0, 0, 0])


@dataclass
class Outputs(Message):
    TYPE: ClassVar[str] = "outputs"
    items: list[OutputItem] = f(_nested(OutputItem))


@dataclass
class RequestError(Message):
    """The scheduler refused ``rid`` (e.g. a prompt that can never fit the pool)."""

    TYPE: ClassVar[str] = "request_error"
    rid: str = f(STR)
    message: str = f(STR)


@dataclass
class AdminReply(Message):
    TYPE: ClassVar[str] = "admin_reply"
    tag: int = f(INT)
    data: dict = f(MAP)


# ---------------------------------------------------------- scheduler <-> worker
@dataclass
class StepReq(Message):
    """One request's share of a step.

    slot: the request's slot (its page table and sampling state live there).
    input_ids: int32 tokens to compute now, at absolute positions
    ``start_pos .. start_pos + len(input_ids) - 1``.
    start_pos: number of tokens already in the KV pool for this slot (cached
    prefix included).
    new_pages: int32 page ids appended to the slot's page table since its last
    step; a slot's first step carries its whole table so far (cached-prefix
    pages included). After appending, the table must cover
    ``start_pos + len(input_ids)`` tokens.
    sample: whether to sample a token after this step (False for non-final
    prefill chunks).
    sampling: given in the step that adds the slot; remembered until released.
    With it come ``prompt_len`` (the request's prompt length: what
    ``min_tokens`` counts from) and, when the parameters have penalties,
    ``history``: every token of the request so far (prompt, then generated),
    from which the penalties' counts start.
    score_ids: prompt tokens to score (prompt logprobs): ``score_ids[j]`` is
    the token at position ``score_pos + j``, scored from the logits of the
    position before it, which this step computes.
    """

    slot: int = f(INT)
    input_ids: np.ndarray = f(I32)
    start_pos: int = f(INT)
    new_pages: np.ndarray = f(I32)
    sample: bool = f(BOOL, True)
    sampling: SamplingParams | None = f(_optional(SAMPLING), None)
    prompt_len: int = f(INT, 0)
    history: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    score_pos: int = f(INT, 0)
    score_ids: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))


@dataclass
class PageCopies(Message):
    """The KV copies between tiers (docs/cache-tiers.md) one step asks for, under a
    ``ticket`` (numbered by the scheduler from 1). The worker performs them in this
    order; what is marked *in step* is done before the step computes anything, the
    rest may run in the background (a copy thread, a copy stream) while steps go on:

    0. ``save``: pool page ``save_pages[i]`` is written to the disk tier as the page
       file of key ``save_keys[32 i : 32 i + 32]`` (write-through of computed pages;
       the page is read in step, the file written in the background);
    1. ``to_disk``: host slot ``to_disk_slots[i]`` is written to the disk tier as the
       page file of key ``to_disk_keys[32 i : 32 i + 32]`` (the slot is read in
       step, the file written in the background);
    2. ``demote``: pool page ``demote_pages[i]`` is copied to host slot
       ``demote_slots[i]`` (in step);
    3. ``promote``: host slot ``promote_slots[i]`` is copied to pool page
       ``promote_pages[i]`` (background);
    4. ``load``: the page file of key ``load_keys[32 i : 32 i + 32]`` is read into
       pool page ``load_pages[i]`` (background).

    The order is what makes one step's copies safe: a slot written to disk may be
    reused by a demotion, and a page demoted may be the target of a promotion.
    The ticket is reported in ``StepResult.copies_done`` once all of it is done;
    until then the scheduler computes on no page being filled and reuses no slot
    or file being read or written.
    """

    save_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    save_keys: bytes = f(KEYS, b"")
    to_disk_slots: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    to_disk_keys: bytes = f(KEYS, b"")
    demote_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    demote_slots: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    promote_slots: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    promote_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    load_keys: bytes = f(KEYS, b"")
    load_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    ticket: int = f(INT, 0)

    def __post_init__(self) -> None:
        n = KEY_BYTES
        pairs = (
            (len(self.save_keys) // n, len(self.save_pages), "save"),
            (len(self.to_disk_keys) // n, len(self.to_disk_slots), "to_disk"),
            (len(self.demote_pages), len(self.demote_slots), "demote"),
            (len(self.promote_slots), len(self.promote_pages), "promote"),
            (len(self.load_keys) // n, len(self.load_pages), "load"),
        )
        for a, b, name in pairs:
            if a != b:
                raise ValueError(f"page copies: {name} has {a} sources and {b} targets")

    def __len__(self) -> int:
        return (
            len(self.save_pages)
            + len(self.to_disk_slots)
            + len(self.demote_pages)
            + len(self.promote_pages)
            + len(self.load_pages)
        )


@dataclass
class GrammarSpec(Message):
    """A structured-output constraint the worker must compile (``StructuredOutput``'s
    fields, and its ``key``)."""

    key: str = f(STR)
    kind: str = f(STR)
    spec: str = f(STR)


@dataclass
class Step(Message):
    """What the worker computes next: the ``copies`` between cache tiers are done
    first (``PageCopies``), then ``release`` slots are cleared, then ``reqs`` run,
    in order. ``step_id`` numbers the scheduler's steps from 1.

    Grammars (docs/structured.md): ``grammars`` are to be compiled (in the
    background; each is reported in a later ``StepResult.grammars_ready`` or
    ``grammar_failures``) and held until named in ``drop_grammars``, after which
    the worker may keep them in its cache of compiled grammars. A slot's
    ``StepReq.sampling`` may name a grammar only once it was reported ready.
    A step with no ``reqs`` waits a little for a compilation, or a ticket of
    copies, in flight.
    """

    TYPE: ClassVar[str] = "step"
    reqs: list[StepReq] = f(_nested(StepReq))
    release: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    step_id: int = f(INT, 0)
    grammars: list[GrammarSpec] = f(_nested(GrammarSpec), [])
    drop_grammars: list[str] = f(STR_LIST, [])
    copies: list[PageCopies] = f(_nested(PageCopies), [])  # none or one (docs/cache-tiers.md)


@dataclass
class Scores(Message):
    """Logprobs the worker computed for ``slot``: of the token at each position
    ``pos .. pos + m - 1`` (prompt tokens it was given, or the token it just
    sampled), with the top ``k`` alternatives of each, most likely first
    (``top_ids`` and ``top_logprobs`` hold m rows of k)."""

    slot: int = f(INT)
    pos: int = f(INT)
    logprobs: np.ndarray = f(F64)
    top_ids: np.ndarray = f(I32)
    top_logprobs: np.ndarray = f(F64)

    def entries(self) -> list[list]:
        """As ``OutputItem`` carries them: one ``[logprob, top ids, top logprobs]`` each."""
        m = len(self.logprobs)
        k = len(self.top_ids) // m if m else 0
        ids = self.top_ids.reshape(m, k).tolist()
        lps = self.top_logprobs.reshape(m, k).tolist()
        return [[lp, i, v] for lp, i, v in zip(self.logprobs.tolist(), ids, lps)]


@dataclass
class Forced(Message):
    """Jump-forward: ``slot``'s new tokens of this step are ``token_ids`` instead of
    its one sampled token (the sampled token followed by the tokens its grammar
    forces, or, when the two merge in tokenization, their retokenization)."""

    slot: int = f(INT)
    token_ids: np.ndarray = f(I32)


@dataclass
class SlotFailure(Message):
    """``slot``'s request must fail with ``message`` (its grammar rejected a token)."""

    slot: int = f(INT)
    message: str = f(STR)


@dataclass
class GrammarFailure(Message):
    """The grammar ``key`` could not be compiled: its requests fail with ``message``."""

    key: str = f(STR)
    message: str = f(STR)


@dataclass
class StepResult(Message):
    """The tokens sampled in step ``step_id`` (one per ``sample=True`` request, in
    order) and the logprobs computed in it.

    Structured output: ``forced`` replaces some slots' sampled token by several;
    ``terminated`` slots' grammars have ended (their requests are complete);
    ``failed`` slots must fail; ``grammars_ready`` and ``grammar_failures``
    report compilations finished since the last step.

    Cache tiers: ``copies_done`` are the tickets of ``PageCopies`` whose copies
    finished since the last step (each reported once, in any order).
    """

    TYPE: ClassVar[str] = "step_result"
    step_id: int = f(INT)
    tokens: np.ndarray = f(I32)
    scores: list[Scores] = f(_nested(Scores), [])
    forced: list[Forced] = f(_nested(Forced), [])
    terminated: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    failed: list[SlotFailure] = f(_nested(SlotFailure), [])
    grammars_ready: list[str] = f(STR_LIST, [])
    grammar_failures: list[GrammarFailure] = f(_nested(GrammarFailure), [])
    copies_done: list[int] = f(INT_LIST, [])


# --------------------------------------------------------------------- control
@dataclass
class Ready(Message):
    """A child finished starting; ``info`` is what the launcher needs from it."""

    TYPE: ClassVar[str] = "ready"
    process: str = f(STR)
    info: dict = f(MAP, {})


@dataclass
class Shutdown(Message):
    """Launcher -> tokenizer: answer everything in flight with ``message`` and exit."""

    TYPE: ClassVar[str] = "shutdown"
    message: str = f(STR)


@dataclass
class Draining(Message):
    """A child acknowledges ``Shutdown``: it now refuses new work (the HTTP front's 503s)."""

    TYPE: ClassVar[str] = "draining"
    process: str = f(STR)


# ------------------------------------------- KV cache events (docs/scale-out.md)
# The schema of the events stream; raised when its meaning changes (a subscriber
# refuses batches of a schema it does not know).
KV_EVENTS_SCHEMA = 1
KV_EVENT_KINDS = ("stored", "removed", "cleared")
FLOAT = Kind("a number", _is_float, float)
SALTS = Kind(
    "a list of strings or nulls",
    lambda x: isinstance(x, list) and all(i is None or isinstance(i, str) for i in x),
)


@dataclass
class KVEvent(Message):
    """One change of a replica's tree, in order.

    ``stored``: pages now cached, a chain: ``hashes[0]``'s parent is ``parent``
    (null: the first page of a prompt), each next page's parent the one before;
    ``tokens`` holds ``page_size`` tokens per page; ``salt`` the cache salt.
    ``removed``: pages evicted (``hashes``), deepest first; a removed page's
    descendants are removed in the same event or before. ``cleared``: the tree is
    empty (a flush, or an eviction that took everything).
    """

    kind: str = f(Kind(f"one of {KV_EVENT_KINDS}", lambda x: x in KV_EVENT_KINDS))
    hashes: bytes = f(KEYS, b"")
    parent: bytes | None = f(_optional(KEY), None)
    tokens: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    salt: str | None = f(_optional(STR), None)


@dataclass
class KVEventBatch(Message):
    """What one scheduler step (or a flush) changed in the tree (PUB, one frame).

    ``seq`` counts batches from 1 per ``epoch`` (a random number drawn at each start
    of the scheduler: a new epoch means a new, empty tree). ``load``: running,
    waiting, pages_free, pages_evictable, num_pages at the time of the batch.
    There is no batch-level salt: one step serves requests of many salts, so each
    ``stored`` event names its own, and every key hashes its salt in, so a
    ``removed`` key needs none (``salt`` is null on ``removed`` and ``cleared``)."""

    TYPE: ClassVar[str] = "kv_events"
    replica: str = f(STR)
    epoch: int = f(INT)
    seq: int = f(INT)
    ts: float = f(FLOAT)
    page_size: int = f(INT)
    events: list[KVEvent] = f(_nested(KVEvent), [])
    load: dict = f(MAP, {})
    schema: int = f(INT, KV_EVENTS_SCHEMA)


@dataclass
class KVHeartbeat(Message):
    """Sent (PUB) when no batch went out for a while: the last ``seq`` and the load.
    A subscriber behind ``seq`` lost a batch and asks for a replay."""

    TYPE: ClassVar[str] = "kv_heartbeat"
    replica: str = f(STR)
    epoch: int = f(INT)
    seq: int = f(INT)
    ts: float = f(FLOAT)
    page_size: int = f(INT)
    load: dict = f(MAP, {})
    schema: int = f(INT, KV_EVENTS_SCHEMA)


@dataclass
class KVReplay(Message):
    """Subscriber -> the replay socket: every batch after ``since`` (-1: a snapshot)."""

    TYPE: ClassVar[str] = "kv_replay"
    since: int = f(INT)


@dataclass
class KVBatches(Message):
    """The replay socket's answer when it still holds every batch after ``since``."""

    TYPE: ClassVar[str] = "kv_batches"
    batches: list[KVEventBatch] = f(_nested(KVEventBatch))


@dataclass
class KVSnapshot(Message):
    """The whole tree as of batch ``seq``, one row per page, parents before children
    (the replay socket's answer when ``since`` is older than its buffer): row i is
    the page with key ``hashes[i]``, parent key ``parents[i]`` (32 zero bytes: none),
    cache salt ``salts[salt_ids[i]]`` and tokens ``tokens[i*page_size:(i+1)*page_size]``."""

    TYPE: ClassVar[str] = "kv_snapshot"
    replica: str = f(STR)
    epoch: int = f(INT)
    seq: int = f(INT)
    ts: float = f(FLOAT)
    page_size: int = f(INT)
    hashes: bytes = f(KEYS, b"")
    parents: bytes = f(KEYS, b"")
    salt_ids: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    salts: list = f(SALTS, [])
    tokens: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    load: dict = f(MAP, {})
    schema: int = f(INT, KV_EVENTS_SCHEMA)


KV_STREAM = {c.TYPE: c for c in (KVEventBatch, KVHeartbeat)}
KV_REPLAY_REPLIES = {c.TYPE: c for c in (KVBatches, KVSnapshot)}
