"""A bounded, seeded fuzz of the HTTP front's bodies: never a 500, never a wedged front.

Bodies are drawn from one seed: valid completion and chat requests with one to
three fields replaced by hostile values (wrong types, out-of-range and huge
integers, NaN, deep nesting, long strings, unknown fields), JSON that is not an
object, truncated JSON and bytes that are not UTF-8. Each answer must be a
success or an OpenAI-shaped 4xx error; afterwards the front still serves and
the scheduler is idle with its invariant intact (``zmq_client``'s check).
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.http.conftest import MODEL

BODIES = 300
COMPLETION = {"model": MODEL, "prompt": "fuzz", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n",
    "seed", "stop", "stream", "stop_token_ids", "ignore_eos", "min_p", "user",
    "response_format", "logit_bias", "stream_options", "extra", "regex", "structured_outputs",
    "tools", "tool_choice",
]  # fmt: skip
WILD = [
    None, True, -1, 0, 1, 2**31, 2**63, 2**64, -(2**64), 1e308, -1e-320, "", "x" * 3000,
    "<|im_end|>\n<|im_start|>system", [], [None], [[[[[]]]]], {}, {"role": 5},
    [{"role": "user"}], [{"role": "user", "content": ["a", {"type": "image"}]}],
    list(range(200)), [-3, 10**12], {"include_usage": "yes"}, {"type": "json_schema"},
    "(", {"json": {"type": "nonsense"}}, {"choice": ["a", 1]}, "required", "auto",
    [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
    {"type": "function", "function": {"name": "f"}},
]  # fmt: skip


def _body(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    kind = rng.random()
    if kind < 0.1:
        return path, rng.randbytes(rng.randint(0, 40))
    if kind < 0.2:
        return path, json.dumps(rng.choice([[1, 2], "x", 3, None, [COMPLETION]])).encode()
    base = dict(COMPLETION if path == "/v1/completions" else CHAT)
    for _ in range(rng.randint(1, 3)):
        base[rng.choice(FIELDS)] = rng.choice(WILD)
    text = json.dumps(base)  # Python's json writes NaN/Infinity for floats out of range
    if kind < 0.3:
        text = text[: rng.randint(0, len(text))]
    return path, text.encode()


@pytest.mark.timeout(300)
def test_hostile_bodies_get_4xx_never_500(http_server, zmq_client):
    rng = random.Random(1201)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=http_server.http_url, timeout=120) as http:
        for _ in range(BODIES):
            path, body = _body(rng)
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, body[:200], r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and len(err["message"]) < 1100
        print(f"\nHTTP statuses of {BODIES} hostile bodies: {statuses}")
        assert statuses.get(400, 0) > BODIES // 3, statuses  # the hostile bodies were refused
        ok = http.post("/v1/completions", json=COMPLETION)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
