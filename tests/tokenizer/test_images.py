"""Images on the tokenizer's side: reading them within the limits (hostile inputs are
ValueErrors naming what is wrong, checked before the costly step they guard), the
digest (the decoded pixels, not the encoding), the placeholder expansion, and the
chat template's image marks."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

from radixserve.tokenizer.config import TokenizerConfig
from radixserve.tokenizer.images import ImageLimits, image_digest, load_image, load_vision_inputs
from radixserve.tokenizer.inputs import InputProcessor
from tests.helpers.tiny_vlm import image_bytes


@pytest.fixture(scope="module")
def vlm_inputs(tiny_vlm_dir):
    from transformers import AutoTokenizer

    folder = tiny_vlm_dir
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = TokenizerConfig(max_images=4, max_image_bytes=200_000, max_image_pixels=1 << 20)
    return InputProcessor(tok, None, cfg, 1024, load_vision_inputs(folder, tok))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose data is one tiny block:
    decoding it would need width x height x 3 bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")  # fmt: skip


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def url_part(data: bytes, mime: str = "png") -> dict:
    url = f"data:image/{mime};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url, "detail": "high"}}


TEXT = {"type": "text", "text": "What is it?"}


def test_chat_images_expand_to_their_tokens(vlm_inputs):
    ids, images = vlm_inputs.to_request(messages=user(url_part(image_bytes(1)), TEXT))
    (im,) = images
    pad = vlm_inputs.vision.token_id
    assert im.grid == [1, 8, 6] and im.tokens == 12  # 90 wide, 120 high: 84x112, 8x6 patches
    assert ids[im.offset : im.end] == [pad] * im.tokens and ids.count(pad) == im.tokens
    assert im.patches().shape == (48, 3 * 2 * 14 * 14)


def test_the_digest_is_the_pixels_not_the_encoding(vlm_inputs):
    png = image_bytes(2)
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="BMP")
    a = load_image(png, ImageLimits())
    b = load_image(buf.getvalue(), ImageLimits())
    assert image_digest(a) == image_digest(b)
    assert image_digest(a) != image_digest(load_image(image_bytes(3), ImageLimits()))


def test_typed_image_tokens_in_chat_text_stay_text(vlm_inputs):
    typed = {"type": "text", "text": "<|image_pad|> and \ue002"}
    ids, images = vlm_inputs.to_request(messages=user(url_part(image_bytes(1)), typed))
    assert len(images) == 1 and ids.count(vlm_inputs.vision.token_id) == images[0].tokens


@pytest.mark.parametrize(
    ("part", "why"),
    [
        (url_part(image_bytes(1))["image_url"]["url"][:-41], "malformed"),  # truncated
        ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not an image"),
        ("data:image/png;base64," + base64.b64encode(image_bytes(1)[:300]).decode(), "corrupt"),
        ("data:image/png;base64," + base64.b64encode(png_header(20000, 20000)).decode(), "max_image_pixels"),
        ("data:image/png;base64," + base64.b64encode(b"x" * 300_000).decode(), "max_image_bytes"),
        ("data:text/plain;base64,aGk=", "data:image"),
        ("http://example.com/cat.png", "not fetched"),
        ("file:///etc/passwd", "not allowed"),
    ],
)  # fmt: skip
def test_hostile_images_are_refused_with_the_reason(vlm_inputs, part, why):
    msgs = user({"type": "image_url", "image_url": {"url": part}}, TEXT)
    with pytest.raises(ValueError, match=why):
        vlm_inputs.to_request(messages=msgs)


def test_tiny_images_and_too_many_images_are_refused(vlm_inputs):
    with pytest.raises(ValueError, match="smaller than the model's 14-pixel patch"):
        vlm_inputs.to_request(messages=user(url_part(image_bytes(1, (1, 1))), TEXT))
    # 1000 images: refused by count before any is decoded (each is garbage).
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}
    with pytest.raises(
        ValueError, match="1000 images in one request; this server allows at most 4"
    ):
        vlm_inputs.to_request(messages=user(*[bad] * 1000))


def test_placeholders_and_images_match_one_to_one(vlm_inputs, tmp_path):
    prompt = "<|vision_start|><|image_pad|><|vision_end|>Hi"
    ids, (im,) = vlm_inputs.to_request(prompt=prompt, images=[image_bytes(1)])
    assert ids[im.offset : im.end] == [vlm_inputs.vision.token_id] * im.tokens
    with pytest.raises(ValueError, match="1 image placeholder"):
        vlm_inputs.to_request(prompt=prompt, images=[image_bytes(1)] * 2)
    # Paths: any for the process's own caller, none over the wire without a directory.
    path = tmp_path / "cat.png"
    path.write_bytes(image_bytes(1))
    assert (
        vlm_inputs.to_request(prompt=prompt, images=[str(path)], trusted=True)[1][0].digest
        == im.digest
    )
    with pytest.raises(ValueError, match="allowed"):
        vlm_inputs.to_request(prompt=prompt, images=[f"file://{path}"])


def test_allowed_media_dir(vlm_inputs, tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(image_bytes(4))
    (tmp_path / "b.png").write_bytes(image_bytes(4))
    limits = ImageLimits(allowed_dir=str(inside))
    assert load_image(f"file://{inside}/a.png", limits).size == (90, 120)
    for outside in (f"file://{tmp_path}/b.png", f"file://{inside}/../b.png"):
        with pytest.raises(ValueError, match="outside the allowed media directory"):
            load_image(outside, limits)


def test_a_text_model_takes_no_images(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert load_vision_inputs(tiny_llama_dir, tok) is None
    inputs = InputProcessor(tok, 512)
    with pytest.raises(ValueError, match="takes no images"):
        inputs.to_request(prompt="hi", images=[image_bytes(1)])
    assert inputs.to_request(prompt="hi") == (inputs.to_ids(prompt="hi"), [])


def test_limits_are_checked_on_a_pil_image_too():
    from PIL import Image

    big = Image.fromarray(np.zeros((2000, 2000, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="max_image_pixels"):
        load_image(big, ImageLimits(max_pixels=1 << 20))


def test_http_images_only_from_allowed_hosts_and_bounded():
    import http.server
    import threading

    body = image_bytes(7)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://example.com/x.png")
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        allowed = ImageLimits(allowed_hosts=("127.0.0.1",), fetch_timeout=5.0)
        assert load_image(url + "/a.png", allowed).size == (90, 120)
        with pytest.raises(ValueError, match="not fetched"):
            load_image(url + "/a.png", ImageLimits(allowed_hosts=("localhost",)))
        with pytest.raises(ValueError, match="max_image_bytes"):
            load_image(url + "/a.png", ImageLimits(allowed_hosts=("127.0.0.1",), max_bytes=1000))
        with pytest.raises(ValueError, match="redirect"):
            load_image(url + "/moved", allowed)
    finally:
        srv.shutdown()
