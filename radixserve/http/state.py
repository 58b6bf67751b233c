"""What every route of the HTTP front shares."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.client import AsyncClient
from radixserve.http.large_bodies import LargeBodies
from radixserve.http.metrics import Metrics
from radixserve.http.response_store import ResponseStore
from radixserve.tokenizer.config import TokenizerConfig

# Room a body leaves for what the front adds to the message it sends on (id, fields).
MESSAGE_OVERHEAD = 64 << 10


def body_limit(max_message_bytes: int) -> int:
    """The largest body the front accepts for a tokenizer that accepts messages of
    ``max_message_bytes``: a message the tokenizer refused would drop the front's
    connection, and with it every request in flight. JSON never encodes a prompt in
    fewer bytes than msgpack does, so a body within this makes a message within that."""
    return max(max_message_bytes - MESSAGE_OVERHEAD, 1)


@dataclass
class FrontState:
    client: AsyncClient  # to the tokenizer process; one socket for every request
    metrics: Metrics
    served_model_name: str
    max_context_len: int
    draining: bool = False  # the server is stopping: new requests get 503
    max_body_bytes: int = body_limit(TokenizerConfig.max_message_bytes)  # else a 413
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's
    large_bodies: LargeBodies = field(default_factory=LargeBodies)
    # What /get_model_info and /get_server_info report (sglang_api.py).
    model_info: dict[str, Any] = field(default_factory=dict)
    server_args: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    model_aliases: tuple[str, ...] = ()  # accepted as ``model`` too; answers carry the name
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice "auto" (tool_parsers.py)
    # The /generate requests (Generations) in flight by their rid, for /abort_request:
    # a request leaves once its response ended, however it ended (sglang_api.generate).
    sglang_requests: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters' names as last listed by the server (``completions.adapter_of``).
    lora_names: set[str] = field(default_factory=set)
    # Earlier responses of /v1/responses, for previous_response_id (responses.py).
    responses: ResponseStore = field(default_factory=ResponseStore)
    dashboard: bool = False  # --dashboard: /dashboard and /dashboard/data (dashboard.py)

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the served model (its name or an alias)."""
        return model == self.served_model_name or model in self.model_aliases
