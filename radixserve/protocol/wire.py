"""The wire format of every message: a msgpack map ``{"type": ..., "v":
PROTOCOL_VERSION, **fields}``, never pickle. Each message is a dataclass whose fields
carry a ``Kind``: how to check a decoded value (and convert it, e.g. int32 bytes to a
numpy array) and how to encode it. ``decode(data, allowed)`` rejects malformed
msgpack, unknown or disallowed types, a wrong version, missing, unknown and
wrong-typed fields with a ``ProtocolError`` that names the problem (and the request
id, when one could be read, so the error reaches the right request). The limits and
heartbeat settings every channel shares live here too.
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
# How an error begins when a request ran past its own ``request_timeout``: the
# client's deadline, not a server failure (the HTTP front answers it with 408).
REQUEST_TIMED_OUT = "the request timed out"
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
F32 = Kind(
    "float32 little-endian bytes",
    lambda x: isinstance(x, bytes) and len(x) % 4 == 0,
    lambda x: np.frombuffer(x, dtype="<f4").astype(np.float32, copy=False),
    lambda x: np.asarray(x, dtype="<f4").tobytes(),
)
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
