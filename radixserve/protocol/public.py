"""The public protocol: what a client sends the tokenizer (``PUBLIC_REQUESTS``)
and what it gets back (``PUBLIC_REPLIES``), over the client DEALER <-> tokenizer
ROUTER channel (docs/protocol.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from radixserve.protocol.disagg import KV_SOURCE
from radixserve.protocol.wire import (
    BOOL,
    FINISH,
    ID,
    INT,
    INT_LIST,
    MAP,
    MAP_LIST,
    PUBLIC_SCORED,
    SAMPLING,
    STR,
    STR_LIST,
    Message,
    _optional,
    f,
)
from radixserve.sampling_params import SamplingParams


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
    # The LoRA adapter to generate with, by name (None: the base model; docs/lora.md).
    lora: str | None = f(_optional(STR), None)
    # A routing key (OpenAI's prompt_cache_key): a router sends a key's requests to
    # one replica. Never a cache namespace (that is cache_salt).
    cache_key: str | None = f(_optional(STR), None)
    # A decode server (--disaggregation decode): the transfer control endpoint of the
    # prefill server to pull the prompt's KV from (the router's PD mode sets it;
    # docs/scale-out.md).
    kv_source: str | None = f(_optional(KV_SOURCE), None)
    # Images of a prompt or input_ids, one per image placeholder token in it, as URLs
    # (data:image/...;base64, or allowed file:// / http(s)://; docs/multimodal.md).
    # A chat's images are in its messages' content parts.
    images: list[str] | None = f(_optional(STR_LIST), None)


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
    the messages; ``tools``: the tool definitions the chat template is given."""

    TYPE: ClassVar[str] = "tokenize"
    id: str = f(ID)
    prompt: str | None = f(_optional(STR), None)
    messages: list[dict] | None = f(_optional(MAP_LIST), None)
    add_special_tokens: bool = f(BOOL, True)
    add_generation_prompt: bool = f(BOOL, True)
    tools: list[dict] | None = f(_optional(MAP_LIST), None)


@dataclass
class Detokenize(Message):
    """The text of token ids, answered with ``Reply(id, {"text"})`` by the tokenizer
    process alone (ids outside the vocabulary are an error); ``skip_special_tokens``
    leaves special tokens' text out, as generated text does."""

    TYPE: ClassVar[str] = "detokenize"
    id: str = f(ID)
    token_ids: list[int] = f(INT_LIST)
    skip_special_tokens: bool = f(BOOL, True)


@dataclass
class LoadLoraAdapter(Message):
    """Load the PEFT adapter folder ``lora_path`` (a path on the server) as
    ``lora_name`` (vLLM's body); answered once the worker has it, or with an ``Error``
    saying why it cannot be served. ``admin_key`` as for ``FlushCache``."""

    TYPE: ClassVar[str] = "load_lora_adapter"
    id: str = f(ID)
    lora_name: str = f(STR)
    lora_path: str = f(STR)
    admin_key: str | None = f(_optional(STR), None)


@dataclass
class UnloadLoraAdapter(Message):
    """Stop serving ``lora_name``: new requests for it are refused at once, the ones
    running finish under it (docs/lora.md). ``admin_key`` as for ``FlushCache``."""

    TYPE: ClassVar[str] = "unload_lora_adapter"
    id: str = f(ID)
    lora_name: str = f(STR)
    admin_key: str | None = f(_optional(STR), None)


@dataclass
class ListLoraAdapters(Message):
    """The adapters served: ``Reply(id, {"loras": [{name, id, path, digest, rank}]})``."""

    TYPE: ClassVar[str] = "list_lora_adapters"
    id: str = f(ID)


@dataclass
class ExplainCache(Message):
    """What the prefix cache would serve of a prompt now, and why no more
    (docs/cache-tiers.md, "Explain"): the prompt as a ``Generate`` gives it (one of
    prompt, input_ids, messages; tools; cache_salt and lora choose the namespace);
    answered with ``Reply(id, report)`` without running the model. An admin call
    (``admin_key`` as for ``FlushCache``): it tells what else is cached."""

    TYPE: ClassVar[str] = "explain_cache"
    id: str = f(ID)
    prompt: str | None = f(_optional(STR), None)
    input_ids: list[int] | None = f(_optional(INT_LIST), None)
    messages: list[dict] | None = f(_optional(MAP_LIST), None)
    tools: list[dict] | None = f(_optional(MAP_LIST), None)
    cache_salt: str | None = f(_optional(STR), None)
    lora: str | None = f(_optional(STR), None)
    admin_key: str | None = f(_optional(STR), None)


@dataclass
class Dashboard(Message):
    """The dashboard's figures (docs/http.md, "Dashboard"): hit rates over time, the
    pool and tier occupancy, the tree's largest prefixes. ``admin_key`` as for
    ``FlushCache``."""

    TYPE: ClassVar[str] = "dashboard"
    id: str = f(ID)
    admin_key: str | None = f(_optional(STR), None)


#: The admin calls that need the admin key when the server has one.
ADMIN_REQUESTS: tuple[type[Message], ...] = (
    FlushCache,
    Check,
    LoadLoraAdapter,
    UnloadLoraAdapter,
    ExplainCache,
    Dashboard,
)

PUBLIC_REQUESTS: dict[str, type[Message]] = {
    c.TYPE: c
    for c in (
        Generate,
        Abort,
        FlushCache,
        Stats,
        Health,
        Check,
        Tokenize,
        Detokenize,
        LoadLoraAdapter,
        UnloadLoraAdapter,
        ListLoraAdapters,
        ExplainCache,
        Dashboard,
    )  # fmt: skip
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
    """The answer to flush_cache / stats / health / check / tokenize / explain_cache /
    dashboard ``id``."""

    TYPE: ClassVar[str] = "reply"
    id: str = f(ID)
    data: dict = f(MAP)


PUBLIC_REPLIES: dict[str, type[Message]] = {c.TYPE: c for c in (Chunk, ResultMsg, Error, Reply)}
