"""The cache's explain over HTTP and the live dashboard page (``http/dashboard.py``).

The shared server runs with ``--dashboard``. The page is tested in a real browser:
headless Chromium loads ``/dashboard`` while a shared-system-prompt bench runs
against the server, and the DOM after its scripts ran must show a non-zero hit rate
and a tree node labelled with the system prompt's first words; a screenshot is
taken (docs/images/dashboard.png is one). Chromium is required: CI installs it
(``.ci/run``), and a machine without it fails here rather than skip the page.
Access rules (admin key, Basic challenge, off without ``--dashboard``) and the fast
path that answers the dashboard's GETs before FastAPI's routing (the same answers as
the routes behind it) are checked on the app in process, without a server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html.parser
import re
import shutil
import subprocess
import tempfile
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from radixserve.benchmark.backends import RadixserveBackend
from radixserve.benchmark.runner import run
from radixserve.benchmark.workloads import Node, Workload
from radixserve.client import ServerError
from radixserve.http import poll_keeper
from radixserve.http.app import create_app
from radixserve.http.auth import Keys
from radixserve.http.dashboard import DashboardFastPath, _Figures
from radixserve.http.metrics import Metrics
from radixserve.http.state import FrontState
from radixserve.models.tokenizer import load_tokenizer

SYSTEM = "You are a careful assistant. Answer the question below in one short sentence."
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def test_explain_a_completion_and_a_chat(http_server, zmq_client):
    url = http_server.http_url
    prompt = "def explain(cache): return the tokens that hit, and why the rest missed"
    zmq_client.generate(prompt, max_tokens=2, temperature=0.0)
    body = {"model": "tiny", "prompt": [prompt[:40] + " and something else entirely", prompt]}
    r = httpx.post(f"{url}/v1/cache/explain", json=body, timeout=60)
    assert r.status_code == 200, r.text
    first, again = r.json()["data"]
    assert again["stop"] == "last_token" and again["hit_tokens"] > 0
    assert first["hit_tokens"] < again["hit_tokens"]
    miss = first["miss"]
    assert miss["position"] == first["agreed_tokens"] > 0
    assert (miss["text_before"] + miss["text_after"]).strip()
    assert miss["continuations"] == 1 and miss["most_common"]["text"]
    assert first["reason"].endswith(".") and first["namespace"]["cache_salt"] is None
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "t"}
    r = httpx.post(f"{url}/v1/cache/explain", json=chat, timeout=60)
    [report] = r.json()["data"]
    assert report["stop"] == "empty_namespace" and report["namespace"]["cache_salt"] == "t"
    # Bad input is a 400 that says why; nothing reaches the scheduler.
    r = httpx.post(f"{url}/v1/cache/explain", json={"model": "tiny"}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/cache/explain", content=b"{", timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/cache/explain", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404


def test_a_completion_that_asks_explains_its_own_hit(http_server, zmq_client):
    url = http_server.http_url
    prompt = "The same long prompt sent twice, so that the second time it hits the cache."
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "explain": True}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["usage"]
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["usage"]
    assert first["explain"]["hit_tokens"] == first["prompt_tokens_details"]["cached_tokens"]
    assert again["explain"]["hit_tokens"] == again["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["explain"]["stop"] == "last_token" and again["explain"]["reason"]
    plain = httpx.post(f"{url}/v1/completions", json={**body, "explain": False}, timeout=120)
    assert "explain" not in plain.json()["usage"]


def test_the_client_explains_too(zmq_client):
    report = zmq_client.explain_cache(input_ids=[5, 6, 7, 8, 9], cache_salt="nobody")
    assert report["stop"] == "empty_namespace" and report["miss"]["text_after"] is not None
    with pytest.raises(ValueError):
        zmq_client.explain_cache()


def _system_workload(tokenizer, groups: int = 2, prompts: int = 6) -> Workload:
    roots = []
    for g in range(groups):
        system = tokenizer.encode(f"{SYSTEM} Topic {g}.", add_special_tokens=False)
        for p in range(prompts):
            question = tokenizer.encode(f" Question {p} about group {g}?", add_special_tokens=False)
            roots.append(Node(f"g{g}-p{p}", system + question, 4))
    return Workload("shared-prefix", {"groups": groups, "prompts": prompts}, roots)


class _Nodes(html.parser.HTMLParser):
    """The tree's nodes (``<g class="node" data-label=...>``) and the cards' values."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[str] = []
        self.ids: dict[str, str] = {}
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "g" and a.get("class") == "node":
            self.labels.append(a.get("data-label") or "")
        self._in = a.get("id")

    def handle_data(self, data):
        if self._in:
            self.ids[self._in] = self.ids.get(self._in, "") + data

    def handle_endtag(self, tag):
        self._in = None


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe, "Chromium is needed to test the dashboard page (Debian: apt-get install chromium)"
    with tempfile.TemporaryDirectory(prefix="rs-chromium-") as profile:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_the_page_in_a_browser_during_a_bench(http_server, model_dir, zmq_client, tmp_path):
    tokenizer = load_tokenizer(str(model_dir))
    workload = _system_workload(tokenizer)

    async def bench():
        backend = RadixserveBackend(http_server.endpoint, timeout=120)
        try:
            return await run(workload, backend, progress=False)
        finally:
            await backend.close()

    asyncio.run(bench())  # the cache holds both system prompts
    during = threading.Thread(target=lambda: asyncio.run(bench()))
    during.start()
    try:
        page = f"{http_server.http_url}/dashboard"
        dom = _chromium("--virtual-time-budget=6000", "--dump-dom", page)
        shot = tmp_path / "dashboard.png"
        _chromium(
            "--virtual-time-budget=6000", f"--screenshot={shot}", "--window-size=960,1000", page
        )
    finally:
        during.join()
    assert dom.returncode == 0, dom.stderr[-2000:]
    nodes = _Nodes()
    nodes.feed(dom.stdout)
    assert "never" not in nodes.ids.get("updated", "never"), nodes.ids
    for card in ("hit-rate", "hit-rate-total"):
        value = re.fullmatch(r"([\d.]+)%", nodes.ids.get(card, "").strip())
        assert value and float(value[1]) > 0, (card, nodes.ids)
    first_words = " ".join(SYSTEM.split()[:3])  # "You are a"
    assert any(label.startswith(first_words) for label in nodes.labels), nodes.labels
    assert shot.stat().st_size > 10_000  # a picture, not an empty page


def test_the_figures_are_bounded_and_cached(http_server, zmq_client):
    url = http_server.http_url
    a = httpx.get(f"{url}/dashboard/data", timeout=60)
    assert a.status_code == 200 and a.headers["content-type"] == "application/json"
    assert a.headers["cache-control"] == "no-store"
    again = httpx.get(f"{url}/dashboard/data", headers={"If-None-Match": a.headers["etag"]})
    if again.headers["etag"] == a.headers["etag"]:  # the same figures: not sent again
        assert again.status_code == 304 and again.content == b""
    else:  # refreshed since
        assert again.status_code == 200 and again.content != a.content
    data = a.json()
    assert len(data["tree"]["nodes"]) <= 64 and len(data["history"]) <= 300
    assert data["history_fields"][0] == "t" and data["stats"]["num_pages"] == 1024
    for node in data["tree"]["nodes"]:
        assert node["parent"] < data["tree"]["nodes"].index(node)
        assert isinstance(node["label"], str)


def test_polls_share_one_fetch_a_second_and_never_wait_for_a_later_one():
    class Slow:
        calls = 0

        async def dashboard(self, timeout=None):
            Slow.calls += 1
            await asyncio.sleep(0.05)
            return {"n": Slow.calls}

    figures = _Figures(ttl=1.0)
    state = FrontState(Slow(), Metrics("m"), "m", 512)  # type: ignore[arg-type]

    async def polls():
        first = await asyncio.gather(*(figures.get(state) for _ in range(200)))
        figures.at -= 2.0  # a second later: stale
        t0 = asyncio.get_running_loop().time()
        stale = await asyncio.gather(*(figures.get(state) for _ in range(200)))
        waited = asyncio.get_running_loop().time() - t0
        await asyncio.sleep(0.1)  # the refresh lands
        return first, stale, waited, await figures.get(state)

    first, stale, waited, fresh = asyncio.run(polls())
    assert {f.body for f in first} == {f.body for f in stale} == {b'{"n":1}'}
    assert fresh.body == b'{"n":2}' and fresh.etag != first[0].etag
    assert Slow.calls == 2 and waited < 0.05  # the stale polls did not wait for the fetch


class _Scheduler:
    """What the front asks of the scheduler for the dashboard: its figures, or a failure."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, 0

    async def dashboard(self, timeout=None):
        self.calls += 1
        if self.fail:
            raise ServerError("the scheduler is gone")
        return {"stats": {"num_pages": 8}, "history": [[0, 1.5]], "note": "é"}


class _Router:
    """An ASGI app (the app's router, or the app), counting the requests that reach it."""

    def __init__(self, router) -> None:
        self.router, self.calls = router, 0

    async def __call__(self, scope, receive, send):
        self.calls += scope["type"] == "http"
        await self.router(scope, receive, send)


def _app(
    keys: Keys,
    dashboard: bool = True,
    fast: bool = True,
    client: _Scheduler | None = None,
    draining: bool = False,
) -> TestClient:
    """The app in process; ``fast=False``: without its dashboard fast path (the routes
    answer). ``app.state.router`` counts what reaches the routing."""
    state = FrontState(client, Metrics("m"), "m", 512, dashboard=dashboard)  # type: ignore[arg-type]
    state.draining = draining
    app = create_app(state, keys)
    if not fast:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not DashboardFastPath]
    app.state.router = app.router = _Router(app.router)  # type: ignore[assignment]
    return TestClient(app)


def _basic(password: str, user: str = "x") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


KEYS = Keys(api_key="user-key", admin_key="admin-key")
ASKS = {  # name: (method, path, headers)
    "no key": ("GET", "/dashboard/data", {}),
    "the API key": ("GET", "/dashboard/data", {"Authorization": "Bearer user-key"}),
    "a wrong Basic": ("GET", "/dashboard/data", _basic("admin-ke")),
    "bad base64": ("GET", "/dashboard/data", {"Authorization": "Basic %%%"}),
    "Bearer": ("GET", "/dashboard/data", {"Authorization": "Bearer admin-key"}),
    "bearer, spaced": ("GET", "/dashboard/data", {"Authorization": "bearer  admin-key "}),
    "x-api-key": ("GET", "/dashboard/data", {"x-api-key": "admin-key"}),
    "Basic": ("GET", "/dashboard/data", _basic("admin-key")),
    "Basic, no user name": ("GET", "/dashboard/data", _basic("admin-key", user="")),
    "with a query": ("GET", "/dashboard/data?t=1", {"Authorization": "Bearer admin-key"}),
    "the page": ("GET", "/dashboard", _basic("admin-key")),
    "the page, no key": ("GET", "/dashboard", {}),
    "HEAD": ("HEAD", "/dashboard/data", {"Authorization": "Bearer admin-key"}),
    "POST": ("POST", "/dashboard/data", {"Authorization": "Bearer admin-key"}),
    "a slash more": ("GET", "/dashboard/data/", {"Authorization": "Bearer admin-key"}),
}
STATUS = {"no key": 401, "the API key": 401, "a wrong Basic": 401, "bad base64": 401,
          "the page, no key": 401, "HEAD": 405, "POST": 405, "a slash more": 307}  # fmt: skip
ROUTED = {"HEAD", "POST", "a slash more"}  # the only ones the routing sees


FIGURES = b'{"stats":{"num_pages":8},"history":[[0,1.5]],"note":"\\u00e9"}'


def _ask_all(keys: Keys, mode: str, fast: bool) -> dict[str, tuple]:
    """Every request of ``ASKS`` on one app: status, headers in order, body, and
    whether it reached the routing."""
    on = {"dashboard": mode != "off", "draining": mode == "draining"}
    answers = {}
    with _app(keys, fast=fast, client=_Scheduler(fail=mode == "failing"), **on) as app:
        router = app.app.state.router  # type: ignore[attr-defined]
        for ask, (method, path, headers) in ASKS.items():
            before = router.calls
            r = app.request(method, path, headers=headers, follow_redirects=False)
            answers[ask] = (
                r.status_code,
                r.headers.multi_items(),
                r.content,
                router.calls > before,
            )
    return answers


@pytest.mark.parametrize("keys", [KEYS, Keys(api_key="admin-key"), Keys()], ids=repr)
@pytest.mark.parametrize("mode", ["on", "off", "draining", "failing"])
def test_the_fast_path_answers_as_the_routes(keys, mode):
    fast, routes = _ask_all(keys, mode, fast=True), _ask_all(keys, mode, fast=False)
    for ask, (_method, path, _headers) in ASKS.items():
        status, headers, body, routed = fast[ask]
        assert (status, headers, body) == routes[ask][:3], ask  # every header, in order
        assert routes[ask][3] and routed == (ask in ROUTED), ask  # the fast path answered
        head = dict(headers)
        if ask in ROUTED:
            assert status == STATUS[ask], ask
        elif mode == "off":
            route = path.partition("?")[0]
            assert status == 404 and f"no route {route} (the server runs" in body.decode(), ask
        elif keys.wanted(admin=True) and STATUS.get(ask) == 401:
            assert status == 401 and '"code":"invalid_api_key"' in body.decode(), ask
            assert head["www-authenticate"] == 'Basic realm="radixserve dashboard"', ask
        elif path == "/dashboard":
            assert status == 200 and head["content-type"] == "text/html; charset=utf-8", ask
        elif mode == "draining":
            assert status == 503 and "shutting down" in body.decode(), ask
        elif mode == "failing":
            assert status == 503 and "did not answer: the scheduler is gone" in body.decode()
        else:
            assert status == 200 and body == FIGURES, ask
            names = [k for k, _ in headers]
            assert names == ["cache-control", "etag", "content-length", "content-type"], ask
            assert head["cache-control"] == "no-store" and head["content-length"] == str(len(body))


def test_a_failed_fetch_is_raised_to_every_poll_until_the_next_one():
    client = _Scheduler(fail=True)
    figures = _Figures(ttl=1.0)
    state = FrontState(client, Metrics("m"), "m", 512)  # type: ignore[arg-type]

    async def polls():
        for _ in range(3):
            with pytest.raises(ServerError, match="the scheduler is gone"):
                await figures.get(state)
        assert client.calls == 1  # one fetch a second, failed or not
        figures.at -= 2.0
        client.fail = False
        return await figures.get(state)

    assert asyncio.run(polls()).body == FIGURES and client.calls == 2


def test_an_unchanged_poll_is_a_304_and_one_fetch_serves_many():
    client = _Scheduler()
    with _app(Keys(), client=client) as app:
        first = app.get("/dashboard/data")
        etag = first.headers["etag"]
        assert re.fullmatch(r'"[0-9a-f]{16}"', etag)
        for known in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            r = app.get("/dashboard/data", headers={"If-None-Match": known})
            assert r.status_code == 304 and r.content == b"", known
            assert r.headers["etag"] == etag and "content-length" not in r.headers
        other = app.get("/dashboard/data", headers={"If-None-Match": '"other"'})
        assert other.status_code == 200 and other.content == first.content
        assert client.calls == 1  # within the second: no new fetch


def test_a_head_too_large_is_431_before_the_fast_path():
    with _app(Keys(), client=_Scheduler()) as app:
        r = app.get("/dashboard/data", headers={"x-pad": "x" * (17 << 10)})
        assert r.status_code == 431
        assert app.app.state.router.calls == 0  # type: ignore[attr-defined]


def test_admin_key_and_the_basic_challenge():
    keys = Keys(api_key="user-key", admin_key="admin-key")
    with _app(keys) as app:
        r = app.get("/dashboard")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")

        def basic(password: str) -> dict[str, str]:
            token = base64.b64encode(f"x:{password}".encode()).decode()
            return {"Authorization": f"Basic {token}"}

        assert app.get("/dashboard", headers=basic("user-key")).status_code == 401
        assert app.get("/dashboard", headers={"Authorization": "Basic %%%"}).status_code == 401
        ok = app.get("/dashboard", headers=basic("admin-key"))
        assert ok.status_code == 200 and "<svg" in ok.text
        assert not re.search(r"(src|href)\s*=|@import|url\(", ok.text)  # nothing from elsewhere
        page = app.get("/dashboard", headers={"Authorization": "Bearer admin-key"})
        assert page.status_code == 200
        for who in ({}, {"Authorization": "Bearer user-key"}):
            assert app.post("/v1/cache/explain", json={}, headers=who).status_code == 401


def test_off_without_the_flag():
    with _app(Keys(), dashboard=False) as app:
        assert app.get("/dashboard").status_code == 404
        assert app.get("/dashboard/data").status_code == 404


def _served(keys: Keys, mode: str, answering: bool):
    """The app as ``_app`` makes it, served by uvicorn on uvloop with the front's
    httptools protocol (``answering``: it answers ready polls itself); a context
    yielding (port, the counter of the requests the app gets)."""
    import socket

    import uvicorn
    import uvloop

    from radixserve.http.connection_limit import ConnectionCap
    from radixserve.http.httptools_protocol import HeadLimitedHttpToolsProtocol
    from radixserve.http.poll_keeper import PollKeeper
    from tests.http.uvicorn_thread import serving

    on = {"dashboard": mode != "off", "draining": mode == "draining"}
    app = _app(keys, client=_Scheduler(fail=mode == "failing"), **on).app
    protocol = HeadLimitedHttpToolsProtocol
    cap = ConnectionCap(64)
    keeper = PollKeeper(app.state.dashboard, cap) if answering else None  # type: ignore[attr-defined]
    if answering:
        protocol = protocol.answering(app.state.dashboard.answer_now, keeper)  # type: ignore[attr-defined]
    counted = _Router(app)  # every request the app gets, its middleware's included
    counted.cap, counted.keeper = cap, keeper  # type: ignore[attr-defined]
    config = uvicorn.Config(
        counted, http=cap.protocol(protocol), lifespan="off", log_level="warning"
    )
    try:
        with serving(config, socket.create_server(("127.0.0.1", 0)), uvloop.new_event_loop) as port:
            yield port, counted
    finally:
        if keeper is not None:
            keeper.close()


def _raw(method: str, path: str, headers: dict[str, str], close: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_answers(sock, count: int, heads_only: set[int] = frozenset()) -> list[tuple]:
    """``count`` answers from ``sock``: (status line, headers but the date, body)."""
    answers, buf = [], b""
    for i in range(count):
        while b"\r\n\r\n" not in buf and (chunk := sock.recv(1 << 16)):
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        status, *lines = head.split(b"\r\n")
        headers = [tuple(line.split(b": ", 1)) for line in lines]
        length = int(dict(headers).get(b"content-length", b"0"))
        if i in heads_only or status.split(b" ")[1] in (b"304", b"307"):
            length = 0 if i in heads_only else length
        while len(buf) < length and (chunk := sock.recv(1 << 16)):
            buf += chunk
        answers.append((status, [h for h in headers if h[0] != b"date"], buf[:length]))
        buf = buf[length:]
    return answers


# ``ASKS`` and heads the protocol's reader of whole polls must leave to the parser or
# answer as it does: a validator, a header of a body, the connection's own tokens.
SERVED = {
    **ASKS,
    "If-None-Match *": ("GET", "/dashboard/data", {"Authorization": "Bearer admin-key",
                                                   "If-None-Match": "*"}),
    "Content-Length 0": ("GET", "/dashboard/data", {"Authorization": "Bearer admin-key",
                                                    "Content-Length": "0"}),
    "keep-alive": ("GET", "/dashboard", {**_basic("admin-key"), "Connection": "keep-alive"}),
    "Expect": ("GET", "/dashboard/data", {"Authorization": "Bearer admin-key",
                                          "Expect": "100-continue"}),
    "spaced value": ("GET", "/dashboard/data", {"AUTHORIZATION": "Bearer admin-key \t"}),
}  # fmt: skip


@pytest.mark.parametrize("keys", [KEYS, Keys()], ids=repr)
@pytest.mark.parametrize("mode", ["on", "off", "draining", "failing"])
def test_the_protocol_answers_ready_polls_as_the_app_does(keys, mode):
    """Served as the front serves it: every request of ``SERVED``, all pipelined on one
    kept-alive connection, then each alone on one kept-alive connection (a whole head
    per read: the protocol's reader of whole polls), then each alone on a connection of
    its own that it closes, answered alike with and without the protocol's own answers
    (every header but the date, in order, and the body); the app sees only what the
    protocol did not answer: with the dashboard on and the figures fetched, no
    authorized GET of the two routes."""
    import socket

    asks = list(SERVED.values())
    heads = {i for i, (method, _p, _h) in enumerate(asks) if method == "HEAD"}
    results = {}
    for answering in (False, True):
        with contextlib.contextmanager(_served)(keys, mode, answering) as (port, counted):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"".join(_raw(*ask) for ask in asks))  # the figures fetched
                pipelined = _read_answers(sock, len(asks), heads)
                before = counted.calls
                sock.sendall(b"".join(_raw(*ask) for ask in asks))
                again = _read_answers(sock, len(asks), heads)
                reached = counted.calls - before
                before = counted.calls
                kept = []
                for i, ask in enumerate(asks):
                    sock.sendall(_raw(*ask))
                    kept += _read_answers(sock, 1, {0} if i in heads else set())
                reached_kept = counted.calls - before
                if answering and mode == "on" and poll_keeper.built():  # it took polls over
                    assert counted.keeper.taken and counted.keeper.returned
            alone = []
            for i, ask in enumerate(asks):
                with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                    sock.sendall(_raw(*ask, close=True))
                    alone += _read_answers(sock, 1, {0} if i in heads else set())
                    assert sock.recv(1) == b""  # closed after its answer
            results[answering] = (pipelined, again, kept, alone, reached, reached_kept)
    assert results[True][:4] == results[False][:4]

    def answered(name: str) -> bool:
        method, path, _headers = SERVED[name]
        route = path.partition("?")[0]
        authorized = not (keys.wanted(admin=True) and STATUS.get(name) == 401)
        return (
            method == "GET"
            and route in ("/dashboard", "/dashboard/data")
            and authorized
            and (mode == "on" or (mode == "failing" and route == "/dashboard"))
        )

    for reached in (4, 5):
        assert results[False][reached] == len(asks)  # every request reached the app
        assert results[True][reached] == len(asks) - sum(map(answered, SERVED))
    if mode == "on":
        assert sum(map(answered, SERVED)) >= 10
