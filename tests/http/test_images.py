"""A vision-language model served for real (``radixserve launch`` with the HTTP front,
a tiny random Qwen2.5-VL in float64, page size 16, 24-token prefill chunks that cut
through the images): OpenAI chat ``image_url`` parts, SGLang's ``image_data`` and the
client library give transformers' greedy tokens, cold and with the image prompt cached;
hostile images are 400s naming the problem, the server goes on, and nothing leaks (no
page held, no encoder run)."""

from __future__ import annotations

import base64

import httpx
import pytest

from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.helpers.tiny_vlm import image_bytes, load_hf_vlm
from tests.models.test_vision_language import hf_oracle
from tests.tokenizer.test_images import png_header

GEN = 8


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm_dir):
    srv = Server(
        tiny_vlm_dir, "--num-pages", "128", "--page-size", "16", "--chunked-prefill-size", "24",
        "--http-port", "0", "--served-model-name", "vlm", "--max-images", "4", "--no-warmup",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def http(vlm_server):
    with httpx.Client(base_url=vlm_server.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def zmq(vlm_server):
    with Client(vlm_server.endpoint, timeout=120) as c:
        yield c


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def openai_chat(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u, "detail": "low"}} for u in urls]
    return [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]},
    ]


def as_engine_chat(messages: list[dict], *images: bytes) -> list[dict]:
    """The same chat as ``hf_oracle`` takes it (images as bytes)."""
    out = [dict(m) for m in messages]
    parts = [{"type": "image", "image": im} for im in images]
    text = [p for p in out[1]["content"] if p["type"] == "text"]
    out[1] = {"role": "user", "content": [*parts, *text]}
    return out


def chat_tokens(http, messages) -> tuple[list[int], dict]:
    body = {"model": "vlm", "messages": messages, "max_tokens": GEN, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["token_ids"], out["usage"]


def test_openai_sglang_and_client_equal_transformers(vlm_server, http, zmq, tiny_vlm_dir):
    hf = load_hf_vlm(tiny_vlm_dir)
    a, b = image_bytes(11, (150, 100)), image_bytes(12, (100, 120))
    messages = openai_chat("Compare these.", data_url(a), data_url(b))
    want = hf_oracle(hf, tiny_vlm_dir, as_engine_chat(messages, a, b))
    cold, usage = chat_tokens(http, messages)
    assert cold == want and usage["prompt_tokens_details"]["cached_tokens"] == 0
    cached, usage = chat_tokens(http, messages)
    assert cached == want
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
    # The client library: the same chat with the images as bytes.
    r = zmq.generate(messages=as_engine_chat(messages, a, b), max_tokens=GEN, temperature=0,
                     ignore_eos=True)  # fmt: skip
    assert r.token_ids == want
    # SGLang's /generate: a text prompt with one placeholder per image_data entry.
    text = "<|vision_start|><|image_pad|><|vision_end|>What is it?"
    body = {"text": text, "image_data": data_url(a),
            "sampling_params": {"max_new_tokens": GEN, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    r1, r2 = (http.post("/generate", json=body).json() for _ in range(2))
    assert (
        r1["output_ids"]
        == r2["output_ids"]
        == zmq.generate(text, images=[a], max_tokens=GEN, temperature=0, ignore_eos=True).token_ids
    )
    assert r2["meta_info"]["cached_tokens"] >= r2["meta_info"]["prompt_tokens"] - 16
    stats = wait_idle(zmq)
    assert stats["encoder_runs"] == 2  # each image once: later requests hit their KV or features


@pytest.mark.parametrize(
    ("url", "why"),
    [
        (data_url(image_bytes(1))[:-41], "malformed"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
        (data_url(image_bytes(1, (1, 1))), "smaller than the model's 14-pixel patch"),
        (data_url(png_header(20000, 20000)), "max_image_pixels"),
        ("http://example.com/cat.png", "not fetched"),
        ("file:///etc/passwd", "not allowed"),
    ],
)
def test_hostile_images_are_400s_and_leak_nothing(http, zmq, url, why):
    before = wait_idle(zmq)
    r = http.post("/v1/chat/completions", json={
        "model": "vlm", "messages": openai_chat("Hi", url), "max_tokens": 2})  # fmt: skip
    assert r.status_code == 400, r.text
    assert why in r.json()["error"]["message"]
    after = wait_idle(zmq)
    assert after["pages_used"] == 0 and after["encoder_runs"] == before["encoder_runs"]
    assert zmq.check() == {"ok": True, "error": None}


def test_too_many_images_and_a_text_request_after(http, zmq):
    many = openai_chat("Hi", *["data:image/png;base64,!!"] * 1000)
    r = http.post("/v1/chat/completions", json={"model": "vlm", "messages": many, "max_tokens": 2})
    assert r.status_code == 400 and "1000 images in one request" in r.json()["error"]["message"]
    body = {"text": "<|image_pad|> <|image_pad|>", "image_data": [data_url(image_bytes(1))]}
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and "2 image placeholder(s) for 1 image(s)" in r.text
    # The server goes on: a plain chat still answers.
    r = http.post("/v1/chat/completions", json={
        "model": "vlm", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200
    assert wait_idle(zmq)["pages_used"] == 0
    assert http.get("/get_model_info").json()["has_image_understanding"] is True


def test_bench_multimodal_against_the_server(vlm_server, tiny_vlm_dir, tmp_path, zmq):
    """``radixserve bench multimodal`` on this server: every request answered, the hit
    rate at the offline optimum over the keyed prompts, each image encoded once."""
    import json

    from radixserve.cli import main as radixserve_main

    out = tmp_path / "mm"
    code = radixserve_main([
        "bench", "multimodal", "--model", str(tiny_vlm_dir), "--endpoint", vlm_server.endpoint,
        "--images", "2", "--questions", "2", "--system-len", "12", "--question-len", "3",
        "--output-len", "2", "--image-size", "112x84", "--no-plot", "--no-progress",
        "--output", str(out), "--warmup", "0",
    ])  # fmt: skip
    assert code == 0
    m = json.loads((tmp_path / "mm.json").read_text())["variants"][0]["metrics"]
    assert (m["requests"], m["failed"], m["images"]) == (4, 0, 2)
    assert m["hit_vs_optimal"] >= 0.95 and m["prompt_count_mismatches"] == 0
    assert m["encoder_runs"] == 2
    assert m["ttft_cold_image_ms"] is not None and m["ttft_repeat_image_ms"] is not None
    wait_idle(zmq)


def test_anthropic_and_responses_images_equal_the_chat_route(http, vlm_server):
    """An image block of Anthropic's Messages API (base64) and an ``input_image`` of
    OpenAI's Responses API are the chat route's ``image_url`` parts: the same greedy
    text for the same conversation."""
    a = image_bytes(21, (120, 90))
    url = data_url(a)
    chat = http.post("/v1/chat/completions", json={
        "model": "vlm", "max_tokens": GEN, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is this?"}]}],
    })  # fmt: skip
    assert chat.status_code == 200, chat.text
    want = chat.json()["choices"][0]["message"]["content"]
    msg = http.post("/v1/messages", json={
        "model": "vlm", "max_tokens": GEN, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.split(",", 1)[1]}},
            {"type": "text", "text": "What is this?"}]}],
    })  # fmt: skip
    assert msg.status_code == 200, msg.text
    assert "".join(b["text"] for b in msg.json()["content"] if b["type"] == "text") == want
    resp = http.post("/v1/responses", json={
        "model": "vlm", "max_output_tokens": GEN, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": "What is this?"}]}],
    })  # fmt: skip
    assert resp.status_code == 200, resp.text
    out = resp.json()["output"][0]["content"][0]["text"]
    assert out == want
