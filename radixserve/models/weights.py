"""Where ``CausalLM.load_weights`` reads checkpoint tensors from: whole, or one slice.

A tensor-parallel rank reads only its slice of each weight (``sharding.Piece``),
so ``SafetensorsReader`` opens the files once and reads slices through
safetensors' lazy ``get_slice`` (the file is memory-mapped: only the slice's
bytes are read and copied). ``TensorDict`` wraps tensors already in memory (a
GGUF file's, dequantized; tests' dicts) and slices them with ``narrow``.
Both take transformers' names; ``renamed`` puts a name map in front of one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from radixserve.models.sharding import Piece


class WeightReader(Protocol):
    def names(self) -> Iterable[str]:
        """Every tensor name the checkpoint has."""
        ...

    def read(self, piece: Piece) -> torch.Tensor:
        """The tensor ``piece.name``, or its rows ``[start, stop)`` along ``piece.dim``."""
        ...


class TensorDict:
    """Tensors in memory, under their checkpoint names."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def read(self, piece: Piece) -> torch.Tensor:
        t = self.tensors[piece.name]
        if piece.dim is None:
            return t
        return t.narrow(piece.dim, piece.start, piece.stop - piece.start)


def safetensors_files(folder: Path) -> list[str]:
    """The weight files of a safetensors checkpoint: the index's (sharded) or every
    ``*.safetensors`` in the folder. FileNotFoundError when there are none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return files


class SafetensorsReader:
    """A safetensors checkpoint (one file, or sharded with ``model.safetensors.index.json``),
    read lazily tensor by tensor and slice by slice."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        files = safetensors_files(folder)
        self._handles = [safe_open(str(folder / f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                self._where[name] = handle

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def read(self, piece: Piece) -> torch.Tensor:
        handle = self._where[piece.name]
        if piece.dim is None:
            return handle.get_tensor(piece.name)
        sl = handle.get_slice(piece.name)
        index = (slice(None),) * piece.dim + (slice(piece.start, piece.stop),)
        return sl[index]


class Renamed:
    """``reader`` under other names: ``names`` maps each new name to the reader's."""

    def __init__(self, reader: WeightReader, names: Mapping[str, str]) -> None:
        self.reader, self.map = reader, names

    def names(self) -> Iterable[str]:
        return self.map.keys()

    def read(self, piece: Piece) -> torch.Tensor:
        return self.reader.read(Piece(self.map[piece.name], piece.dim, piece.start, piece.stop))


def as_reader(weights: Mapping[str, torch.Tensor] | WeightReader) -> WeightReader:
    """A reader for ``weights`` (a mapping of tensors is wrapped)."""
    if isinstance(weights, Mapping):
        return TensorDict(weights)
    return weights
