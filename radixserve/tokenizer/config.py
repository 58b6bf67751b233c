"""The tokenizer's configuration: the limits on what one client may send, and chat parsing.

One frozen dataclass, derived from ``EngineConfig`` by field name like the
worker's and the scheduler's (``radixserve.config.tokenizer_config``). The
limits bound what a single message can cost the server (docs/security.md):
the public socket's message size and reply queue, the prompt, the stop lists,
the samples per request and the requests in flight per client. The in-process
``Engine`` applies the input limits too (the socket ones have no meaning there).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.options import LIMITS, check_options, option, parse_size
from radixserve.sampling_params import MAX_N


@dataclass(frozen=True, kw_only=True)
class TokenizerOptions:
    """The tokenizer's options (docs/security.md has their defaults and why).

    Beyond the flags' help, for the library: a client that lets
    ``max_queued_replies`` replies pile up unread is treated as gone (its requests
    are aborted); the HTTP front is one client, so ``max_requests_per_client`` also
    bounds its requests in flight; ``input_ids`` are checked against
    ``max_prompt_tokens`` before anything else; with ``chat_special_tokens`` a
    ``<|im_end|>`` typed in a user message ends the message.
    """

    max_message_bytes: int = option(
        8 << 20,
        "largest message the public socket accepts (ZMQ_MAXMSGSIZE); a client "
        "sending a larger one is disconnected",
        at_least=1,
        parse=parse_size,
        group=LIMITS,
    )
    max_queued_replies: int = option(
        100_000,
        "replies queued for one client that does not read them (send high-water "
        "mark) before it is treated as gone and its requests aborted",
        at_least=1,
        group=LIMITS,
    )
    max_requests_per_client: int = option(
        1024,
        "requests in flight per client connection (the HTTP front is one client)",
        at_least=1,
        group=LIMITS,
    )
    max_prompt_chars: int = option(
        1 << 20,
        "characters of a prompt (or of a chat's content, tool calls and tools), checked "
        "before tokenizing",
        at_least=1,
        group=LIMITS,
    )
    max_prompt_tokens: int | None = option(
        None, "prompt tokens; default: the model's context less one", at_least=1, group=LIMITS
    )
    max_stop: int = option(
        16,
        "stop strings per request, and stop token ids per request",
        at_least=0,
        group=LIMITS,
    )
    max_stop_len: int = option(256, "characters per stop string", at_least=1, group=LIMITS)
    max_n: int = option(
        16, f"samples per request (at most {MAX_N})", at_least=1, at_most=MAX_N, group=LIMITS
    )
    max_images: int = option(
        16, "images per request (vision-language models)", at_least=0, group=LIMITS
    )
    max_image_pixels: int = option(
        16_777_216,
        "pixels (width x height) of one image, read from its header before it is "
        "decoded (a decompression bomb is refused unopened)",
        at_least=1,
        group=LIMITS,
    )
    max_image_bytes: int = option(
        8 << 20,
        "bytes of one image as sent (encoded: PNG, JPEG, ...)",
        at_least=1,
        parse=parse_size,
        group=LIMITS,
    )
    allowed_media_dir: str | None = option(
        None,
        "a directory whose image files requests may name (file:// URLs); none by default",
        group=LIMITS,
    )
    allowed_media_hosts: tuple[str, ...] = option(
        (),
        "hosts whose http(s):// image URLs requests may name (exact host names); none by "
        "default. The fetch is bounded by --max-image-bytes and --media-fetch-timeout and "
        "follows no redirect",
        group=LIMITS,
    )
    media_fetch_timeout: float = option(
        5.0, "seconds an image fetch from an allowed host may take in all", above=0.0, group=LIMITS
    )
    chat_special_tokens: bool = option(
        False,
        "let special tokens typed inside chat message content act as control "
        "tokens (by default they are plain text)",
        negatable=False,
        group=LIMITS,
    )


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig(TokenizerOptions):
    """The tokenizer's options, checked."""

    def __post_init__(self) -> None:
        check_options(self)
