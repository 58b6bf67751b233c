"""``--served-model-name`` with several names, as vLLM's: every name is accepted as
``model``, ``/v1/models`` lists them, and answers carry the first."""

from __future__ import annotations

import asyncio

import httpx

from radixserve.cli import build_parser, config_from_args
from radixserve.http.app import create_app
from radixserve.http.metrics import Metrics
from radixserve.http.state import FrontState
from radixserve.server_config import ServerConfig


class Tokenizer:
    """A stand-in for the front's client: answers ``tokenize``."""

    async def tokenize(self, prompt=None, **_):
        return [1, 2, 3]

    async def list_lora_adapters(self, timeout=None):
        return [{"name": "ad", "id": 1, "path": "/adapters/ad", "digest": "d", "rank": 4}]


def test_several_names_reach_the_front_and_each_is_served():
    args = build_parser().parse_args(["launch", "--served-model-name", "main", "alias"])
    config = ServerConfig.from_json(config_from_args(args).to_json())
    assert (config.served_model_name, tuple(config.served_model_aliases)) == ("main", ("alias",))
    one = config_from_args(build_parser().parse_args(["launch", "--served-model-name", "x"]))
    assert (one.served_model_name, one.served_model_aliases) == ("x", ())

    async def run() -> None:
        state = FrontState(Tokenizer(), Metrics("main"), "main", 512, model_aliases=("alias",))
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as c:
            cards = (await c.get("/v1/models")).json()["data"]
            assert [card["id"] for card in cards] == ["main", "alias", "ad"]
            assert (cards[2]["parent"], cards[2]["root"]) == ("main", "/adapters/ad")
            for name, status in (("main", 200), ("alias", 200), ("other", 404)):
                r = await c.post("/tokenize", json={"model": name, "prompt": "x"})
                assert r.status_code == status, (name, r.text)

    asyncio.run(run())
