"""Vision-language models (tiny random Qwen2.5-VL and Idefics3, float64) through the
Engine against transformers: greedy tokens equal to ``generate`` cold and with the
image prompt cached, page sizes 1 and 16, chunked prefill cutting through the image;
images in the prefix cache's key (a different image does not hit past the text before
it, the same image hits through it); the encoder runs once per image while its
features are cached."""

from __future__ import annotations

import base64
import contextlib
import io

import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from tests.helpers.tiny_vlm import hf_vlm_greedy, idefics3_oracle, image_bytes, load_hf_vlm

GEN = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm_dir):
    return tiny_vlm_dir


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    return load_hf_vlm(vlm_dir)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    """One Engine on the tiny Qwen2.5-VL for the page-size-1 tests (each flushes its cache
    first and counts encoder runs from its own start); 24-token prefill chunks."""
    with Engine(str(vlm_dir), dtype="float64", page_size=1, num_pages=1024,
                max_running_requests=4, chunked_prefill_size=24, warmup=False) as eng:  # fmt: skip
        yield eng


def fresh(eng: Engine) -> dict:
    """Flush the cache; the stats to count from."""
    eng.flush_cache()
    return eng.stats()


def chat(text: str, *images: bytes) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images]
    return [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]},
    ]


_ORACLE: dict[str, list[int]] = {}


def hf_oracle(hf, folder, messages, n: int = GEN) -> list[int]:
    """transformers alone: its PIL image processor, the processor's placeholder
    expansion, its tokenizer's chat template, its generate (each chat's answer kept
    for the module)."""
    key = repr(messages)
    if key not in _ORACLE:
        _ORACLE[key] = _hf_oracle(hf, folder, messages, n)
    return _ORACLE[key]


def _hf_oracle(hf, folder, messages, n: int) -> list[int]:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    proc = AutoImageProcessor.from_pretrained(folder, backend="pil")
    images = [Image.open(io.BytesIO(p["image"])) for m in messages if not isinstance(m["content"], str)
              for p in m["content"] if p["type"] == "image"]  # fmt: skip
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels, grids = [], []
    for img in images:
        out = proc(images=[img])
        pixels.append(out["pixel_values"])
        grids.append(list(out["image_grid_thw"][0]))
        tokens = int(np.prod(grids[-1])) // proc.merge_size**2
        text = text.replace("<|image_pad|>", "\0" * tokens, 1)
    ids = tok(text.replace("\0", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
    return hf_vlm_greedy(hf, ids, pixels, grids, n)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_hf_cold_cached_and_chunked(vlm_dir, hf_vlm, engine, page_size):
    a, b = image_bytes(1, (150, 100)), image_bytes(2, (100, 120), "JPEG")
    one, two = chat("What is in it?", a), chat("Compare them.", a, b)
    want_one, want_two = hf_oracle(hf_vlm, vlm_dir, one), hf_oracle(hf_vlm, vlm_dir, two)
    # 24-token chunks cut through both images' placeholder runs (20 and 30 tokens).
    if page_size == 1:
        fresh(engine)
    with (
        contextlib.nullcontext(engine)
        if page_size == 1
        else Engine(
            str(vlm_dir),
            dtype="float64",
            page_size=page_size,
            num_pages=1024 // page_size,
            max_running_requests=4,
            chunked_prefill_size=24,
            warmup=False,
        )  # fmt: skip
    ) as eng:
        cold = eng.generate([one, two], GREEDY)
        cached = eng.generate([two, one], GREEDY)
        assert [r.token_ids for r in cold] == [want_one, want_two]
        if page_size == 16:
            # The second prompt waited for the first's first chunk and hit the cache
            # up to a page boundary inside image a: its other rows, features and
            # positions, were computed after the hit.
            _, (image_a, _) = eng.inputs.to_request(messages=two)
            assert image_a.offset < cold[1].usage.cached_tokens < image_a.end
        assert [r.token_ids for r in cached] == [want_two, want_one]
        for r in cached:  # the whole prompt but its last page, images included
            assert r.usage.cached_tokens >= r.usage.prompt_tokens - page_size
        eng.check_idle()


def test_images_key_the_cache_and_the_encoder_runs_once(vlm_dir, hf_vlm, engine):
    a, b = image_bytes(3, (120, 90)), image_bytes(4, (120, 90))
    eng = engine
    start = fresh(eng)

    def counts() -> tuple[int, int]:
        s = eng.stats()
        return (
            s["encoder_runs"] - start["encoder_runs"],
            s["encoder_cache_hits"] - start["encoder_cache_hits"],
        )

    _, (image_a,) = eng.inputs.to_request(messages=chat("Describe it.", a))
    [first] = eng.generate(chat("Describe it.", a), GREEDY)
    assert first.usage.cached_tokens == 0
    assert counts()[0] == 1
    # The same text with another image (same size, so the same placeholder count):
    # no hit past the text before the image.
    [other] = eng.generate(chat("Describe it.", b), GREEDY)
    assert other.usage.cached_tokens == image_a.offset
    assert other.token_ids == hf_oracle(hf_vlm, vlm_dir, chat("Describe it.", b))
    assert counts()[0] == 2
    # The same image with a new question hits through the image; its placeholder
    # run is wholly cached, so the encoder does not run.
    [again] = eng.generate(chat("What colour is it?", a), GREEDY)
    assert again.usage.cached_tokens >= image_a.end
    assert counts()[0] == 2
    # A KV miss on a repeated image: its features come from the encoder cache (once
    # per prefill chunk that holds rows of it).
    eng.flush_cache()
    hits = counts()[1]
    [miss] = eng.generate(chat("Is it big?", a), GREEDY)
    assert miss.usage.cached_tokens == 0
    assert counts()[0] == 2 and counts()[1] > hits
    assert miss.token_ids == hf_oracle(hf_vlm, vlm_dir, chat("Is it big?", a))
    # The same pixels sent another way (a PNG data URL) are the same image.
    url = "data:image/png;base64," + base64.b64encode(a).decode()
    msgs = chat("Is it big?")
    msgs[1]["content"].insert(0, {"type": "image_url", "image_url": {"url": url}})
    [same] = eng.generate(msgs, GREEDY)
    assert same.usage.cached_tokens == same.usage.prompt_tokens - 1
    assert same.token_ids == miss.token_ids
    eng.check_idle()


def test_text_prompt_with_images_and_salts(engine):
    """A text prompt names its images by placeholder (SGLang's image_data); a salt is a
    namespace of its own beside the image key."""
    a = image_bytes(6, (80, 80))
    prompt = "<|vision_start|><|image_pad|><|vision_end|>What is it?"
    eng = engine
    fresh(eng)
    [r1] = eng.generate(prompt, GREEDY, images=[a])
    [r2] = eng.generate(prompt, GREEDY, images=[a], cache_salt="tenant")
    [r3] = eng.generate(prompt, GREEDY, images=[a], cache_salt="tenant")
    assert (r1.usage.cached_tokens, r2.usage.cached_tokens) == (0, 0)
    assert r3.usage.cached_tokens == r3.usage.prompt_tokens - 1
    assert r1.token_ids == r2.token_ids == r3.token_ids
    with pytest.raises(ValueError, match="1 image placeholder"):
        eng.generate(prompt, GREEDY, images=[a, a])
    eng.check_idle()


def test_text_only_prompts_keep_plain_positions(hf_vlm, engine):
    fresh(engine)
    [r] = engine.generate([{"role": "user", "content": "Hello there"}], GREEDY)
    ids = engine.inputs.to_ids(messages=[{"role": "user", "content": "Hello there"}])
    assert r.token_ids == hf_vlm_greedy(hf_vlm, ids, [], [], GEN)


@pytest.mark.parametrize("page_size", [1, 16])
def test_idefics3_greedy_equals_hf_cold_cached_and_chunked(tiny_idefics3_dir, page_size):
    """Idefics3's spans hold tile markers between the tiles' placeholder runs; chunks of
    7 (page 16: 16) tokens cut through tiles."""
    msgs = [{"role": "user", "content": [
        {"type": "image", "image": image_bytes(21, (60, 50))}, {"type": "text", "text": "and"},
        {"type": "image", "image": image_bytes(22, (20, 36))}, {"type": "text", "text": "?"},
    ]}]  # fmt: skip
    key = "idefics3" + repr(msgs)
    if key not in _ORACLE:
        _ORACLE[key] = idefics3_oracle(tiny_idefics3_dir, msgs, GEN)
    want_ids, want = _ORACLE[key]
    with Engine(str(tiny_idefics3_dir), dtype="float64", page_size=page_size,
                num_pages=1024 // page_size, max_running_requests=2,
                chunked_prefill_size=max(7, page_size), warmup=False) as eng:  # fmt: skip
        ids, images = eng.inputs.to_request(messages=msgs)
        assert ids == want_ids and len(images) == 2
        [cold] = eng.generate(msgs, GREEDY)
        [cached] = eng.generate(msgs, GREEDY)
        assert cold.token_ids == cached.token_ids == want
        assert cached.usage.cached_tokens >= cached.usage.prompt_tokens - page_size
        assert eng.stats()["encoder_runs"] == 2
        eng.check_idle()
