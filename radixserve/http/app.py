"""The FastAPI app of the HTTP front: OpenAI's endpoints plus health, cache and metrics.

| route | answer |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | see ``completions.py`` |
| ``POST /v1/messages``, ``POST /v1/messages/count_tokens`` | Anthropic's Messages API: see ``messages.py`` |
| ``POST /v1/responses`` | OpenAI's Responses API: see ``responses.py`` |
| ``GET /v1/models`` | the served model, once per served name (``--served-model-name`` may give several), then each LoRA adapter (``parent``: the model) |
| ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` | vLLM's bodies (``lora_name``, ``lora_path``); admin calls (docs/lora.md) |
| ``GET /health`` | 200 after a round trip through the tokenizer and the scheduler; else 503 |
| ``POST /flush_cache`` | ``{"freed_pages": n}`` (``?keep_disk=true``: keep the disk tier) |
| ``GET /stats`` | the scheduler's stats (``Client.stats()``) |
| ``GET /metrics`` | Prometheus text format (``metrics.py``) |
| ``POST /reset_prefix_cache`` | vLLM's name for ``/flush_cache`` |
| ``POST /v1/cache/explain``; ``GET /dashboard``, ``GET /dashboard/data`` (``--dashboard``) | see ``dashboard.py`` |
| SGLang's ``/generate``, ``/get_model_info``, ``/get_server_info`` (``/server_info``), ``/health_generate``, ``/abort_request``; ``/tokenize``, ``/detokenize`` (SGLang's and vLLM's) | see ``sglang_api.py`` |

With ``--api-key`` / ``--admin-api-key``, routes need a Bearer key (``auth.py``).
Every error is OpenAI's ``{"error": {...}}`` (Anthropic's shape under ``/v1/messages``)
with its status: 400 for a bad body or a request the server refuses, 401 without the
right key, 404 for an unknown model, 503 while the server stops.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from radixserve.client import RequestTimeout, ServerError
from radixserve.http import completions as C
from radixserve.http import dashboard as D
from radixserve.http import messages as M
from radixserve.http import responses as R
from radixserve.http import sglang_api as S
from radixserve.http.auth import NO_KEYS, Keys
from radixserve.http.errors import HTTPError
from radixserve.http.h11_protocol import HeadLimit
from radixserve.http.state import FrontState

log = logging.getLogger("radixserve.http")
T = TypeVar("T")
ADMIN_TIMEOUT_S = 30.0  # health, stats, flush: answered between two scheduler steps
LORA_TIMEOUT_S = 120.0  # a LoRA load: read and checked by the worker in a step


def create_app(state: FrontState, keys: Keys = NO_KEYS) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    # The cache's explain and the dashboard, whose polls are answered by a middleware
    # before the routing (dashboard.py): first, so that HeadLimit wraps it too.
    app.state.dashboard = D.add_routes(app, state, keys)
    app.add_middleware(HeadLimit)  # 431 for a head over MAX_HEAD_BYTES (h11_protocol.py)
    app.state.front = state

    def _error(request: Request, e: HTTPError) -> Response:
        if request.url.path.startswith("/v1/messages"):  # Anthropic's clients read theirs
            return M.anthropic_error(e)
        return e.response()

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> Response:
        return _error(request, e)

    @app.exception_handler(C.ClientGone)
    async def _gone(_request: Request, _e: C.ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left

    @app.exception_handler(ClientDisconnect)
    async def _left_mid_body(request: Request, _e: ClientDisconnect) -> Response:
        # The client's doing, not a failure of this server: one line, no traceback.
        peer = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s left while sending the body of %s %s", peer, request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(404)
    async def _not_found(request: Request, _e: Exception) -> Response:
        return _error(request, HTTPError(404, f"no route {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, _e: Exception) -> Response:
        return _error(
            request, HTTPError(405, f"{request.method} is not allowed on {request.url.path}")
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> Response:
        log.exception("request failed")
        return _error(request, HTTPError(500, f"internal error: {type(e).__name__}: {e}"))

    def _serving() -> None:
        if state.draining:
            raise HTTPError(503, "the server is shutting down")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        keys.check(request)
        _serving()
        return await C.completions(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        keys.check(request)
        _serving()
        return await C.chat_completions(state, request)

    # Anthropic's Messages API (messages.py) and OpenAI's Responses API (responses.py).
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        keys.check(request)
        _serving()
        return await M.messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        keys.check(request)
        _serving()
        return await M.count_tokens(state, request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        keys.check(request)
        _serving()
        return await R.responses(state, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        keys.check(request)
        cards = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "radixserve",
                "max_model_len": state.max_context_len,
            }
            for name in (state.served_model_name, *state.model_aliases)
        ]
        loras = []
        if not state.draining:  # a stopping server still names its model
            loras = await _admin(state.client.list_lora_adapters)
            state.lora_names = {a["name"] for a in loras}
        cards += [
            {
                "id": a["name"],
                "object": "model",
                "created": state.created,
                "owned_by": "radixserve",
                "root": a["path"],
                "parent": state.served_model_name,
                "max_model_len": state.max_context_len,
            }
            for a in loras
        ]
        return {"object": "list", "data": cards}

    async def _lora_body(request: Request, fields: tuple[str, ...]) -> list[str]:
        try:
            body = await request.json()
        except ValueError:
            raise HTTPError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        values = []
        for name in fields:
            value = body.get(name)
            if not isinstance(value, str) or not value:
                raise HTTPError(400, f"{name} must be a non-empty string", name)
            values.append(value)
        return values

    async def _lora_call(call: Callable[..., Awaitable[T]], *args: str) -> T:
        _serving()
        try:
            return await call(*args, timeout=LORA_TIMEOUT_S)
        except RequestTimeout as e:
            raise HTTPError(503, f"the server did not answer: {e}") from None
        except ServerError as e:
            if state.draining:
                raise HTTPError(503, str(e)) from None
            status = 404 if str(e).startswith("unknown LoRA adapter") else 400
            raise HTTPError(status, str(e), "lora_name") from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict:
        keys.check(request, admin=True)
        name, path = await _lora_body(request, ("lora_name", "lora_path"))
        loaded = await _lora_call(state.client.load_lora_adapter, name, path)
        state.lora_names.add(name)
        return loaded

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict:
        keys.check(request, admin=True)
        [name] = await _lora_body(request, ("lora_name",))
        state.lora_names.discard(name)
        return await _lora_call(state.client.unload_lora_adapter, name)

    async def _admin(call: Callable[..., Awaitable[T]]) -> T:
        _serving()
        try:
            return await call(timeout=ADMIN_TIMEOUT_S)
        except (ServerError, RequestTimeout) as e:
            raise HTTPError(503, f"the server did not answer: {e}") from None

    @app.get("/health")
    async def health() -> dict:
        await _admin(state.client.health)
        return {"status": "ok"}

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> dict:
        keys.check(request, admin=True)
        call = state.client.flush_cache
        if request.query_params.get("keep_disk", "false").lower() in ("1", "true"):
            call = functools.partial(call, keep_disk=True)
        return {"freed_pages": await _admin(call)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict:
        keys.check(request, admin=True)
        return {"freed_pages": await _admin(state.client.flush_cache)}

    # SGLang's native API and the tokenizer routes (sglang_api.py).
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        keys.check(request)
        _serving()
        return await S.generate(state, request)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict:
        keys.check(request)
        return S.model_info(state)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info(request: Request) -> dict:
        keys.check(request)
        return S.server_info(state, await _admin(state.client.stats))

    @app.get("/health_generate")
    async def health_generate() -> dict:
        _serving()
        return await S.health_generate(state)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        keys.check(request, admin=True)
        return await S.abort_request(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        keys.check(request)
        _serving()
        return await S.tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        keys.check(request)
        _serving()
        return await S.detokenize(state, request)

    @app.get("/stats")
    async def stats(request: Request) -> dict:
        keys.check(request)
        return await _admin(state.client.stats)

    @app.get("/metrics")
    async def metrics() -> Response:
        _serving()
        text = await state.metrics.render(lambda: _admin(state.client.stats))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
