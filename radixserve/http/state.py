"""What every route of the HTTP front shares."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixserve.client import AsyncClient
from radixserve.http.metrics import Metrics


@dataclass
class FrontState:
    client: AsyncClient  # to the tokenizer process; one socket for every request
    metrics: Metrics
    served_model_name: str
    max_context_len: int
    draining: bool = False  # the server is stopping: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's
