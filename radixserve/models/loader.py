"""Build our model from a model's files (``source.resolve_model`` finds them).

Weights come from safetensors (one file or sharded with an index) or from a
GGUF file (``gguf_loader.py``); the config comes from transformers (for a GGUF
architecture transformers cannot read, built from the file's metadata: ``gguf_hybrid.py``).
A tensor-parallel rank (``comm``) builds its shard and reads only its slices of
the safetensors (``weights.py``) and its slices of a GGUF file's tensors, each
dequantized when read (``gguf_loader.GGUFWeights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from radixserve.layers.parallel import SINGLE, Comm
from radixserve.models.checkpoint import text_weights
from radixserve.models.config import VISION_ARCHITECTURES, ModelConfig
from radixserve.models.decoder import CausalLM
from radixserve.models.source import ModelSource
from radixserve.models.weights import (
    Renamed,
    SafetensorsReader,
    WeightReader,
    safetensors_files,
)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}") from None


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    if source.gguf_file:
        from radixserve.models.gguf_loader import complete_config, own_config

        path = source.folder / source.gguf_file
        own = own_config(path)  # architectures transformers' GGUF reader does not know
        if own is not None:
            return own
        hf = AutoConfig.from_pretrained(str(source.folder), gguf_file=source.gguf_file)
        return complete_config(hf, path)
    return AutoConfig.from_pretrained(str(source.folder))


def read_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint, single file or sharded (index.json)."""
    from safetensors.torch import load_file

    files = safetensors_files(folder)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(folder / f)))
    return weights


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    hf_config: Any = None,
    comm: Comm = SINGLE,
) -> tuple[CausalLM, Any]:
    """Build our model for ``source`` with its weights; returns (model, transformers config).
    ``hf_config``: the source's transformers config when the caller has read it already.
    ``comm``: the tensor-parallel group (the model is then this rank's shard)."""
    if hf_config is None:
        hf_config = load_hf_config(source)
    cfg = ModelConfig.from_hf(hf_config)
    model = CausalLM(cfg, dtype, torch.device(device), comm)  # refuses an unsplittable model
    reader: WeightReader
    if source.gguf_file:
        from radixserve.models.gguf_loader import GGUFWeights

        reader = GGUFWeights(source.folder / source.gguf_file, cfg.num_heads, cfg.num_kv_heads)
    else:
        reader = SafetensorsReader(source.folder)
    names = {k.removeprefix("_orig_mod."): k for k in reader.names()}
    model.load_weights(Renamed(reader, text_weights(cfg, names)))  # type: ignore[arg-type]
    return model, hf_config


def load_vision(
    source: ModelSource, cfg: ModelConfig, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> Any:
    """The vision tower of a vision-language checkpoint (``qwen2_5_vision.py``,
    ``idefics3_vision.py``), or None for a text model (or a GGUF file, which holds the
    text model only)."""
    if cfg.architecture not in VISION_ARCHITECTURES or source.gguf_file:
        return None
    reader = SafetensorsReader(source.folder)
    if cfg.architecture == "Idefics3ForConditionalGeneration":
        from radixserve.models import idefics3_vision

        return idefics3_vision.load_vision_tower(reader, hf_config, dtype, device)
    from radixserve.models import qwen2_5_vision

    return qwen2_5_vision.load_vision_tower(reader, hf_config, dtype, device)
