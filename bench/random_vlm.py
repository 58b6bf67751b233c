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
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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

    # The tests' tiny model's tokenizer (one token per character) and chat template.
    from tests.helpers.tiny_vlm import CHAT_TEMPLATE, CHAT_TOKENS, VISION_TOKENS, _char_tokenizer

    hf_tok, vocab = _char_tokenizer(VISION_TOKENS + CHAT_TOKENS)
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
