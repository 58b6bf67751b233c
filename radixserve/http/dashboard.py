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
waits for one). They carry an ``ETag`` (a hash of the bytes): a poll that sends it
back in ``If-None-Match`` gets a bodiless 304 while the figures have not changed.

The two GET routes are answered by ``DashboardFastPath``, an ASGI middleware in
front of FastAPI's routing, from response objects built once (the page, the 404s)
or once per version of the figures; only a refusal or a failed fetch builds one.
Before the app, the front's httptools protocol asks ``Dashboard.answer_now`` and
writes a ready answer's bytes itself (``httptools_protocol.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.client import RequestTimeout, ServerError
from radixserve.http import completions as C
from radixserve.http.auth import Keys, same_key
from radixserve.http.errors import HTTPError
from radixserve.http.openai_schema import ChatCompletionRequest, CompletionRequest
from radixserve.http.state import FrontState

DATA_TTL_S = 1.0
ADMIN_TIMEOUT_S = 30.0
PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"
CHALLENGE = 'Basic realm="radixserve dashboard"'


@dataclass(frozen=True)
class _Encoded:
    """One version of the figures: their JSON and the two answers made of it, as
    response objects and as raw HTTP/1.1 (``Raw``) for the connection's protocol."""

    body: bytes
    etag: str
    ok: Response
    not_modified: Response
    raw_ok: Raw
    raw_not_modified: Raw

    @classmethod
    def of(cls, body: bytes) -> _Encoded:
        etag = f'"{hashlib.blake2b(body, digest_size=8).hexdigest()}"'
        headers = {"Cache-Control": "no-store", "ETag": etag}
        ok = Response(body, media_type="application/json", headers=headers)
        not_modified = Response(status_code=304, headers=headers)
        return cls(body, etag, ok, not_modified, Raw.of(ok), Raw.of(not_modified))


@dataclass(frozen=True)
class Raw:
    """A ready answer as HTTP/1.1 bytes: the status line, the response's own header
    lines (each ending in CRLF) and the body. The connection's protocol puts uvicorn's
    default headers (server, date) between the two and, where the connection ends,
    ``connection: close`` after them, as uvicorn writes an app's response."""

    status: bytes
    headers: bytes
    body: bytes

    def response(self, default_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
        """The whole answer as uvicorn writes an app's response: the status line,
        uvicorn's ``default_headers``, the answer's own, ``connection: close`` where the
        connection ends, the body."""
        parts = [self.status]
        for name, value in default_headers:
            parts += [name.lower(), b": ", value, b"\r\n"]
        parts.append(self.headers)
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts += [b"\r\n", self.body]
        return b"".join(parts)

    @classmethod
    def of(cls, response: Response) -> Raw:
        status = HTTPStatus(response.status_code)
        lines = [name.lower() + b": " + value + b"\r\n" for name, value in response.raw_headers]
        return cls(
            f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode(),
            b"".join(lines),
            bytes(response.body),
        )


class _Figures:
    """The dashboard's JSON, encoded once per ``ttl`` (module docstring). While a
    fetch is on its way (the scheduler answers between two steps), polls get the
    previous version at once; only a poll with none to get waits for the fetch. A
    failed fetch leaves the previous version served, or, with none, its error raised
    to every poll until the next fetch (one per ``ttl``, as the successful ones)."""

    def __init__(self, ttl: float = DATA_TTL_S) -> None:
        self.ttl = ttl
        self.current: _Encoded | None = None
        self.failed: Exception | None = None  # the last fetch's error
        self.at = float("-inf")
        self.fetching: asyncio.Task | None = None

    def now(self, state: FrontState) -> _Encoded | None:
        """The current version without waiting (a fetch started when it is due), or
        None when there is none yet: then ``get`` waits for it."""
        if self.fetching is None and time.monotonic() - self.at >= self.ttl:
            self.fetching = asyncio.create_task(self._fetch(state))
        return self.current

    async def get(self, state: FrontState) -> _Encoded:
        if self.now(state) is None and self.fetching is not None:
            await asyncio.shield(self.fetching)
        if self.current is None:
            assert self.failed is not None  # a fetch ended, and not with figures
            raise self.failed.with_traceback(None)
        return self.current

    async def _fetch(self, state: FrontState) -> None:
        try:
            data = await state.client.dashboard(timeout=ADMIN_TIMEOUT_S)
            self.current = _Encoded.of(json.dumps(data, separators=(",", ":")).encode())
            self.failed = None
        except Exception as e:  # raised by get() to the polls that have nothing else
            self.failed = e
        finally:
            self.at = time.monotonic()
            self.fetching = None


class Dashboard:
    """The answers of ``GET /dashboard`` and ``GET /dashboard/data``. Every answer but
    a refusal or a failed fetch is a response object built once (the 404s, the page)
    or once per version of the figures, sent as it is to every poll."""

    def __init__(self, state: FrontState, keys: Keys) -> None:
        self.state, self.keys = state, keys
        self.figures = _Figures()
        html = resources.files("radixserve.http").joinpath("static/dashboard.html").read_bytes()
        self.page = Response(html, media_type="text/html; charset=utf-8")
        self.raw_page = Raw.of(self.page)
        self.off = {
            path: HTTPError(
                404, f"no route {path} (the server runs without --dashboard)"
            ).response()
            for path in (PAGE_PATH, DATA_PATH)
        }
        self.draining = HTTPError(503, "the server is shutting down").response()

    def answer_now(self, scope: Scope) -> Raw | None:
        """The answer of a ``GET`` to one of the two routes where it is ready (the page,
        or a version of the figures, to an authorized poll while the server serves), as
        raw bytes for the connection's protocol to write at once; None for every other
        request, which the app answers (``answer`` gives the same bytes where this
        gives any). The front's HTTP/1.1 protocol calls it for each request before it
        would start the app (``httptools_protocol.py``): a poll then costs no task, no
        ASGI messages and no response object."""
        path = scope["path"]
        if path not in (PAGE_PATH, DATA_PATH) or scope["method"] != "GET":
            return None
        state = self.state
        if not state.dashboard or state.draining:
            return None
        if _refusal(Request(scope), self.keys) is not None:
            return None
        if path == PAGE_PATH:
            return self.raw_page
        figures = self.figures.now(state)
        if figures is None:
            return None
        for name, value in scope["headers"]:
            if name == b"if-none-match":
                if _matches(value.decode("latin-1"), figures.etag):
                    return figures.raw_not_modified
                break
        return figures.raw_ok

    def ready(self) -> dict[str, Raw | None]:
        """What ``answer_now`` gives an authorized poll of each route now (None: the
        app answers), for the front's poll keeper (``poll_keeper.py``)."""
        state = self.state
        if not state.dashboard or state.draining:
            return {PAGE_PATH: None, DATA_PATH: None}
        figures = self.figures.current
        return {PAGE_PATH: self.raw_page, DATA_PATH: figures.raw_ok if figures else None}

    def poll_seen(self) -> None:
        """Polls were answered elsewhere (the poll keeper): start a fetch of the
        figures where one is due, as a poll reaching ``answer_now`` does."""
        if self.state.dashboard and not self.state.draining:
            self.figures.now(self.state)

    async def answer(self, path: str, request: Request) -> Response:
        if not self.state.dashboard:
            return self.off[path]
        refusal = _refusal(request, self.keys)
        if refusal is not None:
            return refusal
        if path == PAGE_PATH:
            return self.page
        if self.state.draining:
            return self.draining
        try:
            figures = await self.figures.get(self.state)
        except (ServerError, RequestTimeout) as e:
            return HTTPError(503, f"the server did not answer: {e}").response()
        known = request.headers.get("if-none-match")
        if known is not None and _matches(known, figures.etag):
            return figures.not_modified
        return figures.ok


class DashboardFastPath:
    """ASGI middleware answering ``GET /dashboard`` and ``GET /dashboard/data`` itself.

    A poll is the most frequent request a server with open dashboards gets, and its
    answer is ready-made: FastAPI's routing, its exception and exit-stack layers and
    its request handling took a third of the front's CPU per poll with the front alone
    on a core, a sixth beside the model (bench/results/dashboard_polling.md); uvicorn's
    HTTP/1.1 protocol takes most of the rest. It sits inside the app's own middleware
    (a head too large is still a 431); any other method or path goes on to the app,
    where the two routes give the same answers (and other methods their 405). No
    metric counts these polls, on either path.
    """

    def __init__(self, app: ASGIApp, dashboard: Dashboard) -> None:
        self.app, self.dashboard = app, dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if path in (DATA_PATH, PAGE_PATH) and scope.get("method") == "GET":
            response = await self.dashboard.answer(path, Request(scope))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _refusal(request: Request, keys: Keys) -> Response | None:
    """An admin route for a browser: a Bearer key, or the key as a Basic password;
    without either, the 401 and its challenge (None: the request may pass)."""
    wanted = keys.wanted(admin=True)
    if not wanted:
        return None
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            password = ""
        if any(same_key(password, k) for k in wanted):
            return None
    try:
        keys.check(request, admin=True)
    except HTTPError as e:
        response = e.response()
        response.headers["WWW-Authenticate"] = CHALLENGE
        return response
    return None


def _matches(if_none_match: str, etag: str) -> bool:
    """Whether an If-None-Match header names ``etag`` (weak comparison, as RFC 9110 says)."""
    return any(
        tag == "*" or tag.removeprefix("W/") == etag
        for tag in (t.strip() for t in if_none_match.split(","))
    )


async def _explain_one(state: FrontState, lora: str | None, **prompt: Any) -> dict:
    try:
        return await state.client.explain_cache(lora=lora, timeout=ADMIN_TIMEOUT_S, **prompt)
    except RequestTimeout as e:
        raise HTTPError(503, f"the server did not answer: {e}") from None
    except ServerError as e:
        raise HTTPError(503 if state.draining else 400, str(e)) from None


def add_routes(app: FastAPI, state: FrontState, keys: Keys) -> Dashboard:
    """The explain route, and the dashboard's with ``DashboardFastPath`` in front of
    them. Middleware added later wraps it (``create_app`` adds ``HeadLimit`` after).
    The dashboard is returned for the connection's protocol (``Dashboard.answer_now``)."""
    dashboard = Dashboard(state, keys)
    app.add_middleware(DashboardFastPath, dashboard=dashboard)

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

    # A GET never gets here with DashboardFastPath in front; the routes keep the paths
    # in the app's table (another method: 405) and answer the same without it.
    @app.get(PAGE_PATH)
    async def page(request: Request) -> Response:
        return await dashboard.answer(PAGE_PATH, request)

    @app.get(DATA_PATH)
    async def data(request: Request) -> Response:
        return await dashboard.answer(DATA_PATH, request)

    return dashboard
