"""Images in prompts, on the tokenizer's side (docs/multimodal.md): reading an image a
client sent, within the limits, and turning it into the model's placeholder tokens and
the pixels its vision encoder takes.

An image arrives as bytes, a ``data:image/...;base64,`` URL, a path (the Engine: a
``str`` or ``Path``; over the wire only as ``file://`` under an allowed directory), an
``http(s)://`` URL (fetched only from allowed hosts, ``fetch``) or a PIL image (the
Engine; the client library sends bytes, paths and PIL images as data URLs). Every limit is checked before the costly step it guards: the
encoded size before decoding, the width and height from the header before the pixels
are decoded (a decompression bomb is refused unopened), the number of images before any
is read. A corrupt image is a ValueError naming what is wrong.

``VisionInputs`` is the model's side: its image processor (transformers' slow, PIL and
numpy, one; the same arrays transformers computes), its placeholder token, and the
span an image becomes (one per family: ``Qwen2_5_VLInputs``, ``Idefics3Inputs``). The digest that keys an image in the prefix cache
and the encoder cache is the SHA-256 of the decoded RGB pixels and their size, so the
same picture sent as PNG or as a data URL, or from another path, is the same image.
"""

from __future__ import annotations

import abc
import base64
import binascii
import hashlib
import io
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.protocol import ImageInput
from radixserve.tokenizer.chat import IMAGE_MARK

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.ASCII)


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (``TokenizerConfig``'s limits)."""

    max_images: int = 16
    max_pixels: int = 16_777_216
    max_bytes: int = 8 << 20
    allowed_dir: str | None = None  # file:// and paths below it (None: no files over the wire)
    allowed_hosts: tuple[str, ...] = ()  # http(s):// from these hosts only
    fetch_timeout: float = 5.0  # seconds for one fetch, in all


def decode_base64(text: str, limits: ImageLimits) -> bytes:
    """The bytes of base64 ``text`` (ValueError when it is not base64 or too large)."""
    if len(text) * 3 // 4 > limits.max_bytes + 3:
        raise ValueError(f"an image is larger than max_image_bytes ({limits.max_bytes} bytes)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image's base64 data is malformed (truncated or not base64)") from None


def open_image(data: bytes, limits: ImageLimits) -> Any:
    """Decode encoded image ``data`` to an RGB PIL image, refusing by the header's
    width and height before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ValueError(f"an image is larger than max_image_bytes ({limits.max_bytes} bytes)")
    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise ValueError("an image could not be read: not an image in a known format") from None
    except Image.DecompressionBombError:
        raise ValueError(
            f"an image has more than max_image_pixels ({limits.max_pixels}) pixels"
        ) from None
    check_size(img.size, limits)
    try:
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise ValueError("an image is corrupt: its pixels could not be decoded") from None


def check_size(size: tuple[int, int], limits: ImageLimits) -> None:
    w, h = size
    if w * h > limits.max_pixels:
        raise ValueError(
            f"an image of {w}x{h} pixels is over max_image_pixels ({limits.max_pixels})"
        )
    if w < 1 or h < 1:
        raise ValueError(f"an image of {w}x{h} pixels is empty")


def read_file(path: str | Path, limits: ImageLimits, trusted: bool) -> bytes:
    """A local image file's bytes: anywhere when ``trusted`` (the in-process Engine),
    else only below ``limits.allowed_dir``."""
    p = Path(path)
    if not trusted:
        if limits.allowed_dir is None:
            raise ValueError("file images are not allowed on this server (--allowed-media-dir)")
        root = Path(limits.allowed_dir).resolve()
        p = p.resolve()
        if not p.is_relative_to(root):
            raise ValueError("an image file is outside the allowed media directory")
    try:
        size = p.stat().st_size
        if size > limits.max_bytes:
            raise ValueError(f"an image is larger than max_image_bytes ({limits.max_bytes} bytes)")
        return p.read_bytes()
    except OSError:
        raise ValueError("an image file could not be read") from None


def load_image(source: Any, limits: ImageLimits, trusted: bool = False) -> Any:
    """An RGB PIL image from what a client sent (module docstring). ``trusted``: the
    caller is this process's own code (the Engine), which may name any path."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_size(source.size, limits)
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return open_image(bytes(source), limits)
    if isinstance(source, Path):
        return open_image(read_file(source, limits, trusted), limits)
    if not isinstance(source, str):
        raise ValueError(f"an image must be bytes, a URL or a path, got {type(source).__name__}")
    match = _DATA_URL.match(source)
    if match:
        return open_image(decode_base64(source[match.end() :], limits), limits)
    if source.startswith("data:"):
        raise ValueError("an image data URL must be data:image/<type>;base64,<data>")
    if source.startswith("file://"):
        return open_image(read_file(source.removeprefix("file://"), limits, False), limits)
    if source.startswith(("http://", "https://")):
        return open_image(fetch(source, limits), limits)
    if trusted:
        return open_image(read_file(source, limits, True), limits)
    raise ValueError("an image must be a data:image/...;base64 URL or an allowed URL")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("an image URL redirected; redirects are not followed")


def fetch(url: str, limits: ImageLimits) -> bytes:
    """The bytes at an http(s) ``url`` whose host is allowed, at most
    ``limits.max_bytes`` of them, within ``limits.fetch_timeout`` seconds in all."""
    host = urllib.parse.urlsplit(url).hostname
    if host is None or host not in limits.allowed_hosts:
        raise ValueError("image URLs from this host are not fetched (--allowed-media-hosts)")
    deadline = time.monotonic() + limits.fetch_timeout
    opener = urllib.request.build_opener(_NoRedirect)
    chunks, size = [], 0
    try:
        with opener.open(url, timeout=limits.fetch_timeout) as reply:
            while True:
                if time.monotonic() > deadline:
                    raise ValueError(f"an image fetch took over {limits.fetch_timeout} s")
                chunk = reply.read(64 << 10)
                if not chunk:
                    break
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ValueError(
                        f"an image is larger than max_image_bytes ({limits.max_bytes} bytes)"
                    )
                chunks.append(chunk)
    except (OSError, urllib.error.URLError) as e:
        raise ValueError(f"an image could not be fetched: {str(e)[:100]}") from None
    return b"".join(chunks)


def image_digest(img: Any) -> bytes:
    """SHA-256 of the decoded RGB pixels and the size: the image's identity."""
    h = hashlib.sha256(f"{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.digest()


class VisionInputs(abc.ABC):
    """A vision-language model's image processing: its image processor, the text its
    chat template writes for one image (``image_text``, whose one placeholder token
    ``token_id`` stands for the image in a prompt), and the span an image becomes
    (``span``). The families differ in ``span``."""

    image_text = ""

    def __init__(self, folder: str | Path, hf_config: Any, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
        self.tokenizer = tokenizer
        self.token_id = int(hf_config.image_token_id)
        self.patch = int(hf_config.vision_config.patch_size)
        self.image_ids = list(tokenizer.encode(self.image_text, add_special_tokens=False))
        if self.image_ids.count(self.token_id) != 1:
            raise ValueError(f"the tokenizer does not know the image tokens {self.image_text!r}")

    @abc.abstractmethod
    def span(self, img: Any) -> tuple[list[int], np.ndarray, list[int]]:
        """The image's span ids, its pixels (float32) and its grid."""

    def _process(self, img: Any, **kwargs: Any) -> Any:
        """The image processor's output for one image. An image with a side shorter
        than one patch is refused (the processor would blow it up from less than a
        patch of content)."""
        w, h = img.size
        if min(w, h) < self.patch:
            raise ValueError(
                f"an image of {w}x{h} pixels is smaller than the model's {self.patch}-pixel patch"
            )
        try:
            return self.processor(images=[img], **kwargs)
        except ValueError as e:  # e.g. an aspect ratio the processor refuses
            raise ValueError(f"an image could not be processed: {str(e)[:200]}") from None

    def expand(
        self, ids: Sequence[int], images: Sequence[Any]
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each placeholder token (one per image, in order) replaced by
        its image's span, and the images as the scheduler takes them."""
        sites = [i for i, t in enumerate(ids) if t == self.token_id]
        if len(sites) != len(images):
            raise ValueError(
                f"the prompt has {len(sites)} image placeholder(s) for {len(images)} image(s)"
            )
        out: list[int] = []
        inputs: list[ImageInput] = []
        at = 0
        for site, img in zip(sites, images):
            span, pixels, grid = self.span(img)
            out.extend(ids[at:site])
            inputs.append(
                ImageInput(
                    image_digest(img),
                    len(out),
                    np.asarray(span, dtype=np.int32),
                    self.token_id,
                    list(pixels.shape),
                    pixels.ravel(),
                    grid,
                )  # fmt: skip
            )
            out.extend(span)
            at = site + 1
        out.extend(ids[at:])
        return out, inputs


class Qwen2_5_VLInputs(VisionInputs):
    """Qwen2.5-VL: the template writes ``<|vision_start|><|image_pad|><|vision_end|>``;
    the one ``<|image_pad|>`` becomes one per merged patch, as its processor does."""

    image_text = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, folder: str | Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(folder, hf_config, tokenizer)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def span(self, img: Any) -> tuple[list[int], np.ndarray, list[int]]:
        out = self._process(img)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = [int(g) for g in np.asarray(out["image_grid_thw"])[0]]
        tokens = grid[0] * grid[1] * grid[2] // self.merge**2
        return [self.token_id] * tokens, pixels, grid


class Idefics3Inputs(VisionInputs):
    """Idefics3 (SmolVLM): the template writes ``<image>``; the processor cuts the image
    into rows x columns of tiles plus the whole image, and the ``<image>`` becomes, per
    tile, ``<fake_token_around_image><row_r_col_c>`` and the tile's ``<image>`` tokens
    (a newline after each row), then ``\n<fake_token_around_image><global-img>``, the
    whole image's ``<image>`` tokens and ``<fake_token_around_image>`` (only that last
    part for an image small enough to be one tile), as its processor does."""

    image_text = "<image>"

    def __init__(self, folder: str | Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(folder, hf_config, tokenizer)
        v = hf_config.vision_config
        self.tile_tokens = (v.image_size // v.patch_size) ** 2 // hf_config.scale_factor**2

    def span(self, img: Any) -> tuple[list[int], np.ndarray, list[int]]:
        out = self._process(img, return_row_col_info=True)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)[0]
        if not np.asarray(out["pixel_attention_mask"]).all():
            raise ValueError("an image's tiles came out padded")  # one image: never
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        fake, image = "<fake_token_around_image>", "<image>" * self.tile_tokens
        text = ""
        for r in range(rows):
            text += "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
        text += ("\n" if rows else "") + f"{fake}<global-img>{image}{fake}"
        return list(self.tokenizer.encode(text, add_special_tokens=False)), pixels, []


#: Architecture -> its ``VisionInputs``.
_FAMILIES: dict[str, type[VisionInputs]] = {
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLInputs,
    "Idefics3ForConditionalGeneration": Idefics3Inputs,
}


def load_vision_inputs(folder: str | Path, tokenizer: Any) -> VisionInputs | None:
    """The model's ``VisionInputs``, or None for a text model."""
    from transformers import AutoConfig

    if not (Path(folder) / "config.json").is_file():
        return None
    hf = AutoConfig.from_pretrained(str(folder))
    arch = next((a for a in getattr(hf, "architectures", None) or () if a in _FAMILIES), None)
    return None if arch is None else _FAMILIES[arch](folder, hf, tokenizer)


def split_content(content: Any, limits: ImageLimits, trusted: bool) -> tuple[str, list[Any]]:
    """A chat message's content (a string, or a list of parts: ``{type: text, text}``,
    ``{type: image_url, image_url: {url, detail}}``, ``{type: image, image}``) as text
    with ``IMAGE_MARK`` where each image was, and the images, decoded."""
    if isinstance(content, str):
        return content.replace(IMAGE_MARK, ""), []
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ValueError("message content must be a string or a list of content parts")
    text: list[str] = []
    images: list[Any] = []
    for part in content:
        if not isinstance(part, Mapping):
            raise ValueError("each content part must be an object with a type")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs text (a string)")
            text.append(part["text"].replace(IMAGE_MARK, ""))  # only images make marks
        elif kind in ("image_url", "image"):
            if len(images) >= limits.max_images:
                raise ValueError(f"more than max_images ({limits.max_images}) images in a request")
            images.append(load_image(_image_source(part), limits, trusted))
            text.append(IMAGE_MARK)
        else:
            raise ValueError(f"unsupported content part type {str(kind)[:40]!r}")
    return "".join(text), images


def _image_source(part: Mapping[str, Any]) -> Any:
    if part["type"] == "image":
        if "image" not in part:
            raise ValueError("an image content part needs image")
        return part["image"]
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if not isinstance(url, str):
        raise ValueError("an image_url content part needs image_url.url (a string)")
    detail = spec.get("detail", "auto") if isinstance(spec, Mapping) else "auto"
    # The image processor sizes every image within its pixel bounds: every detail is "auto".
    if detail not in ("auto", "low", "high"):
        raise ValueError(f"image_url.detail must be auto, low or high, got {str(detail)[:20]!r}")
    return url
