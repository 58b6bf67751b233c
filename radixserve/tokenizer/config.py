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

from radixserve.sampling_params import MAX_N


@dataclass(frozen=True)
class TokenizerConfig:
    """Defaults (documented in docs/security.md):

    - ``max_message_bytes`` 8 MiB: the public socket's ``ZMQ_MAXMSGSIZE``; a
      client that sends a larger message is disconnected by ZeroMQ before it is
      read.
    - ``max_queued_replies`` 100000: the public socket's send high-water mark per
      client; a client that lets this many replies pile up unread is treated as
      gone (its requests are aborted).
    - ``max_requests_per_client`` 1024: requests in flight per client identity
      (the HTTP front is one client: this also bounds its requests in flight).
    - ``max_prompt_chars`` 1 Mi: characters of a prompt, or of a chat's content,
      tool calls and tool definitions (their JSON text) together, checked before
      tokenizing.
    - ``max_prompt_tokens`` None: prompt tokens (``input_ids`` are checked before
      anything else is); None: the model's context less one token.
    - ``max_stop`` 16 and ``max_stop_len`` 256: stop strings per request (and stop
      token ids), and characters per stop string.
    - ``max_n`` 16: samples per request.
    - ``chat_special_tokens`` False: special tokens typed inside chat message
      content stay text; True lets them act as control tokens (``<|im_end|>`` in a
      user message then ends the message).
    """

    max_message_bytes: int = 8 << 20
    max_queued_replies: int = 100_000
    max_requests_per_client: int = 1024
    max_prompt_chars: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_stop: int = 16
    max_stop_len: int = 256
    max_n: int = 16
    chat_special_tokens: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes",
            "max_queued_replies",
            "max_requests_per_client",
            "max_prompt_chars",
            "max_stop_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_stop < 0:
            raise ValueError(f"max_stop must be >= 0, got {self.max_stop}")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}], got {self.max_n}")
