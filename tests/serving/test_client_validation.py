"""The client library refuses what it cannot send, and leaves nothing registered behind.
(No server: ZeroMQ connects lazily, and nothing here is ever sent.)"""

from __future__ import annotations

import asyncio

import pytest

from radixserve.client import AsyncClient, Client

NOWHERE = "tcp://127.0.0.1:9"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_ids": [5, 2**64]},
        {"input_ids": [-1]},
        {"prompt": "x", "max_tokens": 2**64},
        {"prompt": "x", "top_k": 2**64},
        {"prompt": "x", "seed": 2**63 - 1, "n": 2},
        {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": {"type": "function"}},
        {"messages": [{"role": "user", "content": "x"}], "tools": ["f"]},
    ],
)
def test_unsendable_values_are_a_value_error_and_leak_nothing(kwargs):
    with Client(NOWHERE, timeout=1) as c:
        with pytest.raises(ValueError):
            c.generate(**kwargs)
        assert c._mail == {}

    async def run():
        async with AsyncClient(NOWHERE, timeout=1) as c:
            with pytest.raises(ValueError):
                await c.generate(**kwargs)
            assert c._queues == {}

    asyncio.run(run())
