"""What the HTTP front shows of the prefix cache: the explain route and the live page.

| route | answer |
|---|---|
| ``POST /v1/cache/explain`` | the body of a completion (each prompt) or a chat request: ``{"object": "cache.explanation", "data": [report per prompt]}`` (``Client.explain_cache``); the model is not run |
| ``GET /dashboard`` | with ``--dashboard``: the live page (``static/dashboard.html``) |
| ``GET /dashboard/data`` | with ``--dashboard``: its figures, JSON (``Client.dashboard``) |

All three are admin routes (the admin key when one is set, else the API key): they
tell what else is cached. A browser cannot add a Bearer header to a page it opens,
so the two dashboard routes also take the key as the password of HTTP Basic
authentication (any user name): without it they answer 401 with a
``WWW-Authenticate: Basic`` challenge, the browser asks for it once and sends it
with the page's polls too. Without ``--dashboard`` they are 404, as unknown routes.

The figures are cached here for ``DATA_TTL_S``: however hard the page (or anything
else) polls, the scheduler is asked at most once per that time, and every poll gets
the last encoded bytes at once, a fetch on its way included (only the first poll
waits for one).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixserve.client import RequestTimeout, ServerError
from radixserve.http import completions as C
from radixserve.http.auth import Keys, same_key
from radixserve.http.errors import HTTPError
from radixserve.http.openai_schema import ChatCompletionRequest, CompletionRequest
from radixserve.http.state import FrontState

DATA_TTL_S = 1.0
ADMIN_TIMEOUT_S = 30.0


class _Figures:
    """The dashboard's JSON, encoded once per ``ttl`` (module docstring). While a
    fetch is on its way (the scheduler answers between two steps), polls get the
    previous bytes at once; only the very first poll waits for them."""

    def __init__(self, ttl: float = DATA_TTL_S) -> None:
        self.ttl = ttl
        self.body = b""
        self.at = float("-inf")
        self.fetching: asyncio.Task | None = None

    async def get(self, state: FrontState) -> bytes:
        stale = not self.body or time.monotonic() - self.at >= self.ttl
        if self.fetching is None and stale:
            self.fetching = asyncio.create_task(self._fetch(state))
        if not self.body:
            await asyncio.shield(self.fetching)  # type: ignore[arg-type]  # raises its error
        return self.body

    async def _fetch(self, state: FrontState) -> None:
        try:
            data = await state.client.dashboard(timeout=ADMIN_TIMEOUT_S)
            self.body = json.dumps(data, separators=(",", ":")).encode()
        finally:
            self.at = time.monotonic()
            self.fetching = None


def _check_page(request: Request, keys: Keys) -> None:
    """An admin route for a browser: a Bearer key, or the key as a Basic password."""
    wanted = keys.wanted(admin=True)
    if not wanted:
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            password = ""
        if any(same_key(password, k) for k in wanted):
            return
    try:
        keys.check(request, admin=True)
    except HTTPError as e:
        response = e.response()
        response.headers["WWW-Authenticate"] = 'Basic realm="radixserve dashboard"'
        raise _Challenge(response) from None


class _Challenge(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


async def _explain_one(state: FrontState, lora: str | None, **prompt: Any) -> dict:
    try:
        return await state.client.explain_cache(lora=lora, timeout=ADMIN_TIMEOUT_S, **prompt)
    except RequestTimeout as e:
        raise HTTPError(503, f"the server did not answer: {e}") from None
    except ServerError as e:
        raise HTTPError(503 if state.draining else 400, str(e)) from None


def add_routes(app: FastAPI, state: FrontState, keys: Keys) -> None:
    """The explain route, and the dashboard's when ``state.dashboard``."""
    figures = _Figures()
    html = resources.files("radixserve.http").joinpath("static/dashboard.html").read_bytes()

    @app.exception_handler(_Challenge)
    async def _challenge(_request: Request, e: _Challenge) -> Response:
        return e.response

    @app.post("/v1/cache/explain")
    async def explain(request: Request) -> dict:
        keys.check(request, admin=True)
        if state.draining:
            raise HTTPError(503, "the server is shutting down")
        raw = await request.body()
        try:
            chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):
            chat = False  # parse() answers the 400
        body = await C.parse(state, request, ChatCompletionRequest if chat else CompletionRequest)
        lora = await C.adapter_of(state, body.model)
        if isinstance(body, ChatCompletionRequest):
            prompts = [{"messages": body.messages_as_dicts(), "tools": body.tools_as_dicts()}]
        else:
            prompts = [
                {"prompt": p} if isinstance(p, str) else {"input_ids": p} for p in body.prompts()
            ]
            if not prompts:
                raise HTTPError(400, "prompt must not be an empty list", "prompt")
        reports = [
            await _explain_one(state, lora, cache_salt=body.cache_salt, **p) for p in prompts
        ]
        return {"object": "cache.explanation", "data": reports}

    @app.get("/dashboard")
    async def page(request: Request) -> Response:
        if not state.dashboard:
            raise HTTPError(404, "no route /dashboard (the server runs without --dashboard)")
        _check_page(request, keys)
        return Response(html, media_type="text/html; charset=utf-8")

    @app.get("/dashboard/data")
    async def data(request: Request) -> Response:
        if not state.dashboard:
            raise HTTPError(404, "no route /dashboard/data (the server runs without --dashboard)")
        _check_page(request, keys)
        if state.draining:
            raise HTTPError(503, "the server is shutting down")
        try:
            body = await figures.get(state)
        except (ServerError, RequestTimeout) as e:
            raise HTTPError(503, f"the server did not answer: {e}") from None
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})
