"""Where a model's files are: a model name resolved to a folder or a GGUF file.

A model is named by one of:
- ``None`` or ``"smollm2"``: the embedded SmolLM2-135M-Instruct (``embedded.py``;
  converted into the cache dir on first use);
- a folder with ``config.json`` and safetensors (one file or sharded with an index);
- a ``.gguf`` file (config and tokenizer via transformers, weights via ``gguf``).

This module imports no torch: the tokenizer process resolves the same names
as the worker without loading the model stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from radixserve.models.embedded import EMBEDDED_NAME, ensure_smollm2


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: an HF folder, or a GGUF file (``gguf_file`` set)."""

    name: str
    folder: Path
    gguf_file: str | None = None


def resolve_model(
    model: str | None, cache_dir: str | os.PathLike[str] | None = None
) -> ModelSource:
    """Map a model name to its files; ValueError saying what is accepted otherwise."""
    if model is None or model == EMBEDDED_NAME:
        return ModelSource(EMBEDDED_NAME, ensure_smollm2(cache_dir))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.name, path.parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path)
    raise ValueError(
        f"model {model!r} is not {EMBEDDED_NAME!r}, a folder with config.json, or a .gguf file"
    )
