"""Save a random Qwen2.5-VL of a chosen size (an HF folder: weights, image processor,
a tokenizer of one token per character, a chat template) for ``radixserve bench
multimodal`` on a machine without downloaded checkpoints.

    python bench/random_vlm.py /tmp/vlm-medium --hidden 512 --layers 8 --vision-hidden 384
    radixserve bench multimodal --model /tmp/vlm-medium --compare cache=radix,none

Random weights decide nothing about quality; what the benchmark measures (the cache's
hits, the prefill and encoder time a hit saves) depends only on the shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
            "<|im_start|>", "<|im_end|>"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vision-hidden", type=int, default=384)
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    args = p.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models

    base = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(base + SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=SPECIALS,
    )  # fmt: skip
    half = args.hidden // args.heads // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = dict(
        vocab_size=len(vocab) + 4, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.context,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    depth = args.vision_depth
    vision = dict(
        depth=depth, hidden_size=args.vision_hidden, intermediate_size=3 * args.vision_hidden,
        num_heads=max(1, args.vision_hidden // 64), out_hidden_size=args.hidden, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[i for i in range(depth) if i % 4 == 3],
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    args.folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.folder)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(args.folder)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(args.folder)
    print(f"wrote {args.folder}")


if __name__ == "__main__":
    main()
