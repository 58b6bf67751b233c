"""Load the HF tokenizer that belongs to a model name (see ``source.resolve_model``).

Imports no torch (transformers is imported when a tokenizer is loaded).
"""

from __future__ import annotations

import os
from typing import Any

from radixserve.models.gguf_hybrid import HYBRID_GGUF_ARCHITECTURES
from radixserve.models.source import resolve_model


def _gguf_architecture(path: Any) -> str:
    import gguf

    return str(gguf.GGUFReader(str(path)).fields["general.architecture"].contents())


def load_tokenizer(model: str | None, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """A transformers tokenizer for ``model``.

    ``None``/``"smollm2"``: the converted copy in the cache dir (converted on first use);
    a folder: ``AutoTokenizer`` on it (``tokenizer.json``, or a sentencepiece
    ``tokenizer.model`` with a ``tokenizer_config.json``); a ``.gguf`` file: transformers'
    GGUF tokenizer conversion (for an architecture transformers reads no config of, the
    hybrids, straight into a fast tokenizer: ``AutoTokenizer`` would read the config).
    """
    from transformers import AutoTokenizer

    source = resolve_model(model, cache_dir)
    if source.gguf_file:
        if _gguf_architecture(source.folder / source.gguf_file) in HYBRID_GGUF_ARCHITECTURES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(
                str(source.folder), gguf_file=source.gguf_file
            )
        return AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(str(source.folder))
