"""Images in the prefix cache's key (docs/multimodal.md).

An image's placeholder tokens all carry one real token id (``<|image_pad|>``), so two
prompts that differ only in their image would share KV. The scheduler keys a request by
its prompt with each image's span (its placeholders, and the tokens the processor puts
between them, all fixed by the image) replaced by ids derived from the image's
digest (a SHA-256 of its decoded pixels and size): ``KEY_IDS`` negative int32 ids, from
four 31-bit pieces of the digest, repeated along the span. No vocabulary id is negative,
so a key id never equals a text token; two different images part at their span's first
token (31 bits), and a whole page of 4 or more tokens compares 124 bits. The same image
in two prompts gives the same ids, so a prompt hits the cache through an image it
repeats. Salts and LoRA namespaces are a separate part of the key and compose with it.

The request's token buffer holds the keyed prompt (every cache call reads it); the
worker is sent the real ids (``real_ids``) and the images themselves, with the step
that adds the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve.protocol import ImageInput

KEY_IDS = 4  # distinct key ids per image, each from 31 bits of its digest


def key_ids(digest: bytes) -> np.ndarray:
    """The image's key ids: ``KEY_IDS`` negative int32 values."""
    pieces = np.frombuffer(digest[: 4 * KEY_IDS], dtype="<u4").astype(np.int64)
    return (-1 - (pieces & 0x7FFFFFFF)).astype(np.int32)


def check_images(prompt: np.ndarray, images: Sequence[ImageInput]) -> None:
    """ValueError unless each image's span lies in the prompt, after the one before it,
    and holds the ids the image says."""
    at = 0
    for im in images:
        if im.offset < at or im.end > len(prompt):
            raise ValueError("image spans overlap or leave the prompt")
        if not (prompt[im.offset : im.end] == im.ids).all():
            raise ValueError("an image's span holds other tokens than its own")
        at = im.end


def keyed_prompt(prompt: np.ndarray, images: Sequence[ImageInput]) -> np.ndarray:
    """The prompt as the cache keys it: each image's span replaced by its key ids."""
    if not images:
        return prompt
    out = prompt.copy()
    for im in images:
        out[im.offset : im.end] = np.resize(key_ids(im.digest), im.tokens)
    return out


def real_ids(ids: np.ndarray, start: int, images: Sequence[ImageInput]) -> np.ndarray:
    """Keyed tokens ``ids`` (from position ``start``) with image spans given back their
    real ids (a copy where a span is touched; ``ids`` itself otherwise)."""
    end = start + len(ids)
    out = ids
    for im in images:
        lo, hi = max(start, im.offset), min(end, im.end)
        if lo < hi:
            if out is ids:
                out = ids.copy()
            out[lo - start : hi - start] = im.ids[lo - im.offset : hi - im.offset]
    return out
