"""The worker's side of images in prompts (docs/multimodal.md): the vision encoder
with its cache of features, and the slots' images and multimodal positions.

A slot's images come with the step that adds it (``StepReq.images``, with its
sampling). From then on, whatever part of the prompt a step computes (a prefill after
a cache hit that ends inside an image, a chunk cutting through one), the rows of
placeholder tokens in it get their image's feature rows (the k-th placeholder of an
image's span the k-th row). A model with multimodal positions (Qwen2.5-VL's M-RoPE,
the tower's ``mrope``) gives every row its positions, computed once per slot from the
whole prompt (``qwen2_5_vision.mrope_positions``): a cached prefix's positions are
never sent, they are recomputed. Rows past the prompt are at ``position + delta``.
Other models' positions are the plain ones.

A vision tower (``qwen2_5_vision.VisionTower``, ``idefics3_vision.VisionTower``)
answers ``encode(pixels, grid)``: the image's feature rows, one per placeholder.

``EncoderCache`` keeps features by image digest (the scheduler keys the prefix
cache by the same digest), least recently used first out, within a byte budget;
an image is encoded only when a step needs rows of it and its features are not
cached, so an image whose placeholder run is wholly in a cache hit never runs the
encoder. ``runs`` and ``hits`` count encoder runs and features served from the
cache; the step's counts go back in ``StepResult``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.models.qwen2_5_vision import mrope_positions
from radixserve.models.rope import MROPE_ROWS
from radixserve.protocol import ImageInput


class EncoderCache:
    """Image features by digest, LRU within ``max_bytes`` (0: keeps nothing)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> torch.Tensor | None:
        features = self._entries.get(digest)
        if features is not None:
            self._entries.move_to_end(digest)
        return features

    def put(self, digest: bytes, features: torch.Tensor) -> None:
        """Keep ``features`` (evicting the least recently used), unless they alone
        exceed the budget."""
        size = features.numel() * features.element_size()
        if size > self.max_bytes or digest in self._entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[digest] = features
        self.bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


class VisionEncoder:
    """The vision tower behind its cache; counts its runs and cache hits."""

    def __init__(self, tower: Any, cache_bytes: int) -> None:
        self.tower = tower
        self.cache = EncoderCache(cache_bytes)
        self.runs = 0
        self.hits = 0

    def features(self, image: ImageInput) -> torch.Tensor:
        """The image's features [placeholders, hidden], from the cache or the tower."""
        cached = self.cache.get(image.digest)
        if cached is not None:
            self.hits += 1
            return cached
        # A copy: the pixels are a read-only view of the message's bytes.
        features = self.tower.encode(torch.from_numpy(image.patches().copy()), image.grid)
        placeholders = int((image.ids == image.token_id).sum())
        if features.shape[0] != placeholders:
            raise ValueError(
                f"an image of {placeholders} placeholder tokens gave {features.shape[0]} features"
            )
        self.runs += 1
        self.cache.put(image.digest, features)
        return features


@dataclass
class _SlotImages:
    images: list[ImageInput]
    rows: list[np.ndarray]  # per image, per span position: its feature row (-1: none)
    positions: np.ndarray | None  # M-RoPE: [3, prompt_len] int64
    delta: int


class MultimodalSlots:
    """Each slot's images and prompt positions (module docstring)."""

    def __init__(self, encoder: VisionEncoder) -> None:
        self.encoder = encoder
        self.mrope = bool(getattr(encoder.tower, "mrope", False))
        self._slots: dict[int, _SlotImages] = {}

    def add(self, slot: int, images: list[ImageInput], prompt_len: int) -> None:
        """The slot's prompt of ``prompt_len`` tokens holds ``images`` (none: text,
        whose positions are the plain ones)."""
        self._slots.pop(slot, None)
        if not images:
            return
        at = 0
        for im in images:
            if im.offset < at or im.end > prompt_len:
                raise ValueError(f"slot {slot}: image placeholder runs overlap or leave the prompt")
            at = im.end
        rows = []
        for im in images:
            at_placeholder = im.ids == im.token_id
            row = np.full(im.tokens, -1, dtype=np.int64)
            row[at_placeholder] = np.arange(int(at_placeholder.sum()))
            rows.append(row)
        positions, delta = None, 0
        if self.mrope:
            runs = [(im.offset, im.tokens, im.grid) for im in images]
            positions, delta = mrope_positions(prompt_len, runs, self.encoder.tower.merge)
        self._slots[slot] = _SlotImages(list(images), rows, positions, delta)

    def clear(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def positions(self, slot: int, start: int, end: int) -> np.ndarray:
        """Rows ``start .. end - 1`` of the slot: their M-RoPE positions [3, n] (plain
        positions [n] for a model without)."""
        if not self.mrope:
            return np.arange(start, end, dtype=np.int64)
        state = self._slots.get(slot)
        if state is None or state.positions is None:
            return np.broadcast_to(np.arange(start, end, dtype=np.int64), (MROPE_ROWS, end - start))
        out = np.empty((MROPE_ROWS, end - start), dtype=np.int64)
        prompt_len = state.positions.shape[1]
        split = min(max(start, min(end, prompt_len)), end)
        out[:, : split - start] = state.positions[:, start:split]
        out[:, split - start :] = np.arange(split, end) + state.delta
        return out

    def embeds(
        self, slot: int, start: int, end: int, row: int
    ) -> list[tuple[np.ndarray, torch.Tensor]]:
        """The features of the slot's placeholder tokens at positions ``start .. end - 1``,
        whose first is flat batch row ``row``: (rows, features) per image touched."""
        state = self._slots.get(slot)
        if state is None:
            return []
        out = []
        for im, rows in zip(state.images, state.rows):
            lo, hi = max(start, im.offset), min(end, im.end)
            if lo >= hi:
                continue
            picked = rows[lo - im.offset : hi - im.offset]
            at = np.flatnonzero(picked >= 0)
            if not len(at):
                continue  # only the tokens between tiles: no feature rows
            features = self.encoder.features(im)[torch.from_numpy(picked[at])]
            out.append((at + lo - start + row, features))
        return out
