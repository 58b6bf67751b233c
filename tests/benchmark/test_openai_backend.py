"""The OpenAI-compatible backend against a canned SSE peer (stdlib http.server).

The peer stands in for a remote server: it records each request body and
answers /v1/completions with the stream a vLLM-style server sends (text chunks,
then a usage chunk with prompt_tokens_details.cached_tokens, then [DONE]).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from radixserve.benchmark.backends import OpenAIBackend
from radixserve.benchmark.metrics import summarize
from radixserve.benchmark.runner import run
from radixserve.benchmark.workloads import Node, Workload
from radixserve.sampling_params import StructuredOutput


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class Peer(BaseHTTPRequestHandler):
    bodies: list[dict] = []
    with_ids = True  # send choices[0].token_ids (vLLM's return_token_ids)
    cached: int | None = 3  # None: no prompt_tokens_details
    usage = True  # False: no usage chunk (llama-cpp-python's server)

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "peer-model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Peer.bodies.append(body)
        if body["prompt"] == [666]:
            return self._json(400, {"error": {"message": "bad prompt"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        out = [10 + i for i in range(body["max_tokens"])]
        self.wfile.write(b": keep-alive comment\n\n")
        for t in out:
            choice = {"index": 0, "text": f"<{t}>", "finish_reason": None}
            if Peer.with_ids:
                choice["token_ids"] = [t]
            self.wfile.write(sse({"object": "text_completion", "choices": [choice]}))
            self.wfile.flush()
        if not Peer.usage:
            last = {"index": 0, "text": "", "finish_reason": "length"}
            self.wfile.write(sse({"object": "text_completion", "choices": [last]}))
            self.wfile.write(b"data: [DONE]\n\n")
            return
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(out)}
        if Peer.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": Peer.cached}
        self.wfile.write(sse({"object": "text_completion", "choices": [], "usage": usage}))
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def base_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def reset_peer():
    Peer.bodies, Peer.with_ids, Peer.cached, Peer.usage = [], True, 3, True


async def collect(backend, prompt, max_tokens):
    return [ev async for ev in backend.stream(prompt, max_tokens)]


def test_stream_parses_text_ids_and_usage(base_url):
    async def go():
        b = OpenAIBackend(base_url, extra_body={"return_token_ids": True}, page_size=16)
        info = await b.info()
        events = await collect(b, [5, 6, 7, 8], 3)
        await b.close()
        return info, events

    info, events = asyncio.run(go())
    assert info.model == "peer-model" and info.page_size == 16
    assert [e.text for e in events] == ["<10>", "<11>", "<12>", ""]
    assert [e.token_ids for e in events[:3]] == [[10], [11], [12]]
    last = events[-1]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 3)
    assert last.usage.cached_tokens == 3 and last.cached_known
    body = Peer.bodies[0]
    assert body["prompt"] == [5, 6, 7, 8] and body["model"] == "peer-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["return_token_ids"] is True
    assert body["temperature"] == 0.0 and body["max_tokens"] == 3


def test_http_error_is_raised(base_url):
    async def go():
        b = OpenAIBackend(base_url, model="m")
        try:
            await collect(b, [666], 2)
        finally:
            await b.close()

    with pytest.raises(RuntimeError, match="HTTP 400.*bad prompt"):
        asyncio.run(go())


def test_runner_over_http_without_ids_or_cached_counts(base_url):
    """No token ids back: the next turn's prompt uses the re-tokenized answer; no
    cached_tokens reported: the hit rate is unknown (None), not 0."""
    Peer.with_ids, Peer.cached = False, None
    turn2 = Node("c0-t1", [30, 31], 2)
    w = Workload("multi-turn", {}, [Node("c0-t0", [1, 2, 3], 2, [turn2])])

    def encode(text: str) -> list[int]:  # "<10><11>" -> [10, 11]
        return [int(x) for x in text.strip("<>").split("><")]

    async def go():
        b = OpenAIBackend(base_url, model="m")
        try:
            return await run(w, b, encode=encode, progress=False)
        finally:
            await b.close()

    result = asyncio.run(go())
    assert [r.prompt_ids for r in result.records] == [[1, 2, 3], [1, 2, 3, 10, 11, 30, 31]]
    assert Peer.bodies[1]["prompt"] == [1, 2, 3, 10, 11, 30, 31]
    m = summarize(result, page_size=1)
    assert m["requests"] == 2 and m["failed"] == 0
    assert m["hit_rate"] is None and m["cached_tokens"] is None
    assert m["optimal_hit_rate"] == pytest.approx(4 / 10)  # turn 2 reuses 1,2,3,10
    assert m["prompt_count_mismatches"] == m["output_count_mismatches"] == 0
    assert all(len(r.chunk_times) == 2 for r in result.records)  # the usage chunk is no token


def test_structured_request_sends_a_response_format(base_url):
    """A json-extract request: its schema as OpenAI's strict ``response_format``,
    without ignore_eos (it ends with the object); json_object too; regex has none."""
    schema = {"type": "object", "properties": {"is_peer_reviewed": {"type": "boolean"}}}

    async def go():
        b = OpenAIBackend(base_url, model="m")
        try:
            for so in (StructuredOutput.json(schema), StructuredOutput.json_object()):
                _ = [ev async for ev in b.stream([5, 6], 2, structured=so)]
            with pytest.raises(ValueError, match="no response_format for a regex"):
                _ = [ev async for ev in b.stream([5], 2, structured=StructuredOutput.regex("a"))]
        finally:
            await b.close()

    asyncio.run(go())
    first, second = Peer.bodies
    assert first["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "record", "schema": schema, "strict": True},
    }
    assert second["response_format"] == {"type": "json_object"}
    assert first["ignore_eos"] is False and first["return_token_ids"] is True


def test_text_prompts_to_a_server_without_usage(base_url):
    """``prompt_text`` (llama-cpp-python's server takes no token ids): the prompt goes as
    text, and a stream without usage is counted by the client (the prompt's ids, the
    re-tokenized answer), with no cache figure; without ``prompt_text`` a missing
    usage stays an error."""
    Peer.with_ids, Peer.usage = False, False
    w = Workload("shared-prefix", {}, [Node("a", [1, 2, 3], 2), Node("b", [1, 2, 4], 2)])

    def encode(text: str) -> list[int]:
        return [int(x) for x in text.strip("<>").split("><")]

    async def go(prompt_text):
        b = OpenAIBackend(base_url, model="m", prompt_text=prompt_text)
        try:
            return await run(w, b, encode=encode, progress=False, max_concurrency=1)
        finally:
            await b.close()

    result = asyncio.run(go(lambda ids: " ".join(f"t{i}" for i in ids)))
    assert [b["prompt"] for b in Peer.bodies] == ["t1 t2 t3", "t1 t2 t4"]
    assert all(r.error is None for r in result.records)
    assert [(r.usage.prompt_tokens, r.usage.completion_tokens) for r in result.records] == [
        (3, 2), (3, 2),
    ]  # fmt: skip
    m = summarize(result, page_size=1)
    assert m["failed"] == 0 and m["hit_rate"] is None
    failed = asyncio.run(go(None))
    assert all(r.error == "the stream ended without usage" for r in failed.records)
