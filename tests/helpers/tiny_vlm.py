"""Tiny random vision-language models saved as HF folders, with their image processor
and a chat template, and transformers' own greedy run on them as the oracle.

``make_tiny_qwen2_5_vl(folder)`` writes config.json, model.safetensors (float64), a
one-token-per-character tokenizer with Qwen's vision tokens, the slow (PIL) image
processor's preprocessor_config.json (small pixel bounds: images of 4 to 64 placeholder
tokens) and a chat template that renders image parts as Qwen's
``<|vision_start|><|image_pad|><|vision_end|>``.

``hf_vlm_greedy(hf, ids, pixels, grids, n)`` is transformers' ``generate`` (greedy, its
own KV cache) on the expanded prompt, with the model patched to compute norms and
rotary in float64 (``patch_hf_vlm_float64``).
"""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import numpy as np
import torch

from tests.helpers.tiny_models import _rmsnorm64

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# 56x56 .. 224x224 pixels: 2x2 .. 8x8 merged tokens (patch 14, merge 2).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224


def _char_tokenizer(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    base = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(base + specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=specials,
    )  # fmt: skip
    return hf, vocab


def _widen(model: torch.nn.Module) -> None:
    """Random init gives near-flat logits; widen the weights so greedy has clear winners."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / p[0].numel() ** 0.5)


def make_tiny_qwen2_5_vl(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL (2 text layers, 2 vision blocks: one windowed, one
    full) with its tokenizer, image processor and chat template; returns ``folder``."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok, vocab = _char_tokenizer(VISION_TOKENS + CHAT_TOKENS)
    text = dict(
        vocab_size=len(vocab) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 3, 3]},
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[1], in_channels=3,
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float64)
    _widen(model)
    model.save_pretrained(folder)
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor.save_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


IDEFICS3_TOKENS = [
    "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
    *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
]  # fmt: skip
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}<image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def make_tiny_idefics3(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random Idefics3 (SmolVLM: a 2-layer Llama text model, a 2-layer SigLIP
    tower on 32-pixel tiles of 8-pixel patches, pixel shuffle 2: 4 tokens a tile) with
    its tokenizer, image processor (images up to 64 pixels a side: up to 2 x 2 tiles
    and the whole image) and chat template; returns ``folder``."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok, vocab = _char_tokenizer([*CHAT_TOKENS, *IDEFICS3_TOKENS])
    text = dict(
        vocab_size=len(vocab) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = transformers.Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=2,
        image_token_id=vocab["<image>"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).to(torch.float64)
    _widen(model)
    model.save_pretrained(folder)
    processor = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
    )
    processor.save_pretrained(folder)
    tok.chat_template = IDEFICS3_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def idefics3_oracle(
    folder: str | Path, messages: list[dict], n: int
) -> tuple[list[int], list[int]]:
    """transformers alone on an Idefics3 chat with ``{type: image, image: bytes}`` parts:
    its tokenizer's template, its ``Idefics3Processor`` (tiles, prompt expansion), its
    greedy ``generate`` in float64. Returns (the expanded prompt ids, the tokens)."""
    import transformers
    from PIL import Image

    from tests.helpers.tiny_models import patch_hf_float64

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    images = [Image.open(io.BytesIO(p["image"])) for m in messages if not isinstance(m["content"], str)
              for p in m["content"] if p["type"] == "image"]  # fmt: skip
    proc = transformers.Idefics3Processor(
        transformers.AutoImageProcessor.from_pretrained(folder, backend="pil"), tok,
        image_seq_len=4,
    )  # fmt: skip
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = proc(text=[text], images=[images] if images else None, add_special_tokens=False)
    hf = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float64)
    patch_hf_float64(hf.eval())
    ids = torch.as_tensor(np.asarray(out["input_ids"]))
    kwargs = {}
    if images:
        kwargs = dict(
            pixel_values=torch.as_tensor(np.asarray(out["pixel_values"]), dtype=torch.float64),
            pixel_attention_mask=torch.as_tensor(np.asarray(out["pixel_attention_mask"])),
        )
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, **kwargs)  # fmt: skip
    return ids[0].tolist(), gen[0, ids.shape[1] :].tolist()


def image_bytes(seed: int, size: tuple[int, int] = (90, 120), fmt: str = "PNG") -> bytes:
    """A random RGB image (width, height) encoded as ``fmt``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _vision_rotary64(self, x: torch.Tensor, position_ids: torch.Tensor):
    quarter = self.config.hidden_size // self.config.num_heads // 2
    theta = self.config.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float64) / quarter))
    freqs = position_ids[..., None].to(torch.float64) * inv
    return self.recomposition_frequencies(freqs.cos()), self.recomposition_frequencies(freqs.sin())


def _text_rotary64(self, x: torch.Tensor, position_ids: torch.Tensor):
    cfg = self.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    position_ids = position_ids.expand(3, -1, -1)
    freqs = position_ids[..., None].to(torch.float64) * inv
    cos, sin = (
        self.recomposition_frequencies(freqs.cos()),
        self.recomposition_frequencies(freqs.sin()),
    )
    return cos.to(x.dtype), sin.to(x.dtype)


def _rotary_vision64(q, k, cos, sin):
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def patch_hf_vlm_float64(model: torch.nn.Module) -> torch.nn.Module:
    """Make a float64 Qwen2.5-VL compute its RMSNorms, both rotaries and the vision
    rotary's application in float64 (transformers keeps them in float32)."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm64, module)
        elif name == "Qwen2_5_VLVisionRotaryEmbedding":
            module.forward = types.MethodType(_vision_rotary64, module)
        elif name == "Qwen2_5_VLRotaryEmbedding":
            module.forward = types.MethodType(_text_rotary64, module)
    sys.modules[type(model).__module__].apply_rotary_pos_emb_vision = _rotary_vision64
    return model


def load_hf_vlm(folder: str | Path) -> torch.nn.Module:
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float64
    )
    return patch_hf_vlm_float64(model.eval())


def hf_vlm_greedy(hf, ids, pixels: list[np.ndarray], grids: list, n: int) -> list[int]:
    """transformers' greedy ``generate`` on the expanded prompt ``ids`` with the images'
    flat patches and grids (none: a text prompt)."""
    input_ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)[None]
    kwargs = {}
    if pixels:
        image_id = hf.config.image_token_id
        kwargs = dict(
            pixel_values=torch.as_tensor(np.concatenate(pixels), dtype=torch.float64),
            image_grid_thw=torch.as_tensor(np.asarray(grids), dtype=torch.long),
            mm_token_type_ids=(input_ids == image_id).to(torch.int32),
        )
    with torch.no_grad():
        out = hf.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
            do_sample=False, min_new_tokens=n, **kwargs,
        )  # fmt: skip
    return out[0, input_ids.shape[1] :].tolist()
