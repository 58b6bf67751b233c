"""API keys of the HTTP front: which routes need which key, and the keys never reach a
command line."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from radixserve.http.app import create_app
from radixserve.http.auth import ADMIN_KEY_ENV, API_KEY_ENV, Keys
from radixserve.http.metrics import Metrics
from radixserve.http.state import FrontState
from tests.http.conftest import MODEL


class Admin:
    """A stand-in for the front's client: answers the admin calls."""

    async def stats(self, timeout=None):
        return {"running": 0}

    async def flush_cache(self, timeout=None):
        return 3

    async def health(self, timeout=None):
        return {"status": "ok"}

    async def list_lora_adapters(self, timeout=None):
        return []


def call(keys: Keys, method: str, path: str, key: str | None) -> int:
    async def run() -> int:
        state = FrontState(Admin(), Metrics(MODEL), MODEL, 512)
        transport = httpx.ASGITransport(app=create_app(state, keys))
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as c:
            r = await c.request(method, path, headers=headers)
            if r.status_code == 401:
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and "Bearer" in err["message"]
            return r.status_code

    return asyncio.run(run())


BOTH = Keys(api_key="user-key", admin_key="admin-key")


@pytest.mark.parametrize(
    ("keys", "method", "path", "key", "status"),
    [
        (Keys(), "GET", "/v1/models", None, 200),
        (Keys(), "POST", "/flush_cache", None, 200),
        (BOTH, "GET", "/v1/models", None, 401),
        (BOTH, "GET", "/v1/models", "wrong", 401),
        (BOTH, "GET", "/v1/models", "user-key", 200),
        (BOTH, "GET", "/v1/models", "admin-key", 200),
        (BOTH, "GET", "/stats", "user-key", 200),
        (BOTH, "POST", "/flush_cache", "user-key", 401),
        (BOTH, "POST", "/flush_cache", "admin-key", 200),
        (BOTH, "POST", "/v1/load_lora_adapter", "user-key", 401),
        (BOTH, "POST", "/v1/unload_lora_adapter", "user-key", 401),
        (BOTH, "POST", "/v1/load_lora_adapter", "admin-key", 400),  # past the key: no body
        (BOTH, "POST", "/v1/completions", None, 401),  # refused before the body is read
        (BOTH, "GET", "/health", None, 200),
        (Keys(api_key="user-key"), "POST", "/flush_cache", "user-key", 200),
        (Keys(api_key="user-key"), "POST", "/flush_cache", None, 401),
        (Keys(admin_key="admin-key"), "GET", "/v1/models", None, 200),
        (Keys(admin_key="admin-key"), "POST", "/flush_cache", None, 401),
        # vLLM's and SGLang's routes: the admin ones, then those of the API key
        (BOTH, "POST", "/reset_prefix_cache", "user-key", 401),
        (BOTH, "POST", "/reset_prefix_cache", "admin-key", 200),
        (BOTH, "POST", "/abort_request", "user-key", 401),
        (BOTH, "POST", "/abort_request", "admin-key", 400),  # in, but without a body
        (BOTH, "POST", "/generate", None, 401),
        (BOTH, "POST", "/tokenize", None, 401),
        (BOTH, "POST", "/detokenize", None, 401),
        (BOTH, "GET", "/get_model_info", None, 401),
        (BOTH, "GET", "/get_model_info", "user-key", 200),
        (BOTH, "GET", "/get_server_info", None, 401),
        (BOTH, "GET", "/server_info", "user-key", 200),
    ],
)
def test_routes_need_their_key(keys, method, path, key, status):
    assert call(keys, method, path, key) == status


def test_keys_come_from_the_flags_else_the_environment(monkeypatch):
    from radixserve.cli import build_parser, http_keys

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    assert http_keys(build_parser().parse_args(["launch"])) == Keys("from-env", None)
    args = build_parser().parse_args(["launch", "--api-key", "a", "--admin-api-key", "b"])
    assert http_keys(args) == Keys("a", "b")


@pytest.mark.timeout(180)
def test_a_launched_front_needs_the_key_and_no_child_shows_it(model_dir):
    """The key is given on the launcher's environment; the HTTP child enforces it and
    no child's command line or (but the HTTP front's) environment carries it."""
    from tests.helpers.server import Server

    secret = "s3cret-" + os.urandom(4).hex()
    os.environ[API_KEY_ENV] = secret
    try:
        srv = Server(model_dir, "--num-pages", "64", "--http-port", "0")
    finally:
        del os.environ[API_KEY_ENV]
    try:
        url = srv.http_url
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
        assert ok.status_code == 200
        for name, pid in srv.pids.items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret.encode() not in cmdline, name
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert (secret.encode() in environ) == (name == "http"), name
    finally:
        assert srv.stop() == 0
