"""Sliding layers in a window pool of their own, end to end against transformers.

Tiny Mistral (a window on every layer), Gemma 2 (sliding and global layers
alternating), Gemma 3 (two sliding layers, then a global one) and Qwen3 (a global
layer, then a sliding one: ``max_window_layers``), windows shorter
than the prompts, in float64: greedy tokens through the Engine equal transformers'
while the window pool is small enough that the tree drops window pages (matches
then end where a window is missing), the same prompts hit the cache beyond the
window, and requests are retracted; at idle no page of either pool is held by
anything but the tree. The KV bytes a cached token holds past the window drop by the
sliding layers' share.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.worker.kv_pool import min_window_pages
from tests.helpers.tiny_models import hf_cached_greedy, make_tiny_model, patch_hf_float64

GEN = 24
# family -> (window, extra config, sliding layers, layers)
FAMILIES = {
    "mistral": (8, {"sliding_window": 8}, 2, 2),
    "gemma2": (16, {}, 1, 2),
    "gemma3": (16, {}, 2, 3),
    # layer_types: a full layer, then a sliding one.
    "qwen3": (8, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, 1, 2),
}


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    return patch_hf_float64(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    )


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            _, extra, _, _ = FAMILIES[family]
            made[family] = make_tiny_model(tmp_path_factory.mktemp(family), family, seed=5, **extra)
        return made[family]

    return get


def prompts_for(seed: int) -> list[list[int]]:
    """Four prompts of 30-60 tokens, two pairs sharing a 24-token prefix."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        shared = rng.integers(4, 512, 24).tolist()
        out += [shared + rng.integers(4, 512, int(rng.integers(6, 36))).tolist() for _ in range(2)]
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_pool_greedy_equals_hf(family_dirs, family, page_size):
    window, _, sliding, layers = FAMILIES[family]
    folder = family_dirs(family)
    hf = load_hf(folder)
    first, other = prompts_for(1), prompts_for(2)
    want = {tuple(p): hf_cached_greedy(hf, p, GEN) for p in first + other}
    slots, chunk = 4, 16
    floor = min_window_pages(window, page_size, slots, chunk)
    eng = Engine(
        str(folder), dtype="float64", page_size=page_size, num_pages=400 // page_size,
        sliding_pool_pages=floor + 4, max_running_requests=slots, chunked_prefill_size=chunk,
    )  # fmt: skip
    runner, sched = eng.runner, eng.scheduler
    assert runner.window_pool is not None and runner.window_span == window
    assert sched.kv.window is not None and sched.kv.window.num_pages == floor + 4
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)

    def check(prompts):
        got = [r.token_ids for r in eng.generate(prompts, sp)]
        assert got == [want[tuple(p)] for p in prompts]
        eng.check_idle()

    check(first)
    hits = eng.stats()["hit_tokens"]
    check(first)  # the same prompts again: hits past the window
    again = eng.stats()["hit_tokens"] - hits
    assert again > 4 * window, f"hits {again} not beyond the window"
    check(other)  # other prompts: the window pool is short, the tree drops window pages
    check(first + other)
    stats = eng.stats()
    assert stats["window_evicted_pages"] > 0, "the window pool never ran short"
    # Bytes a cached token holds past the window: the full layers' only.
    per_token, one_pool = runner.bytes_per_cached_token, runner.bytes_per_token_one_pool
    assert per_token * layers == one_pool * (layers - sliding)
    # Measured: the bytes the tree holds per cached token (full pages, and the window
    # pages it kept) against one pool's.
    info, cache = runner.info(), sched.cache
    held = cache.cached_pages * runner.page_bytes + cache.components["window"].cached_pages * (
        info.window_page_bytes
    )
    measured = held / (cache.cached_pages * page_size)
    assert measured < one_pool
    print(
        f"{family} page {page_size}: {per_token} B per cached token past the window, "
        f"{measured:.0f} B measured over {cache.cached_pages * page_size} cached tokens "
        f"(one pool: {one_pool} B)"
    )
    eng.close()


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_window_pool_retraction_and_aborts_leak_nothing(family_dirs, family):
    """A full pool too small for the running requests: the newest are retracted and
    resume from the tree; a request aborted by a stop string releases its pages;
    at idle both pools are whole (``check_idle``)."""
    window, _, _, _ = FAMILIES[family]
    folder = family_dirs(family)
    hf = load_hf(folder)
    prompts = prompts_for(3)
    want = [hf_cached_greedy(hf, p, 40) for p in prompts]
    eng = Engine(
        str(folder), dtype="float64", page_size=1, num_pages=150, max_running_requests=4,
        chunked_prefill_size=16, decode_reserve_ratio=0.0,
    )  # fmt: skip
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in eng.generate(prompts, sp)] == want
    assert eng.stats()["preemptions"] > 0, "nothing was retracted"
    eng.check_idle()
    # Aborts: a stop string ends a request mid-decode.
    text = eng.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    stop = text[len(text) // 2 :][:3]
    if stop.strip():
        eng.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))
    eng.check_idle()
    sched = eng.scheduler
    w = sched.kv.window
    assert w.num_free + int(np.count_nonzero(w.held)) == w.num_pages
    eng.close()


def test_one_pool_when_asked(family_dirs):
    """``sliding_pool_pages=0``: one pool for every layer, as before."""
    eng = Engine(str(family_dirs("gemma2")), dtype="float64", num_pages=128,
                 sliding_pool_pages=0)  # fmt: skip
    assert eng.runner.window_pool is None and eng.scheduler.kv.window is None
    assert eng.runner.info().window_pages == 0
    eng.close()


@pytest.mark.parametrize(
    "options",
    [
        {"cache": "none"},
        {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3},
        {"page_size": 4, "speculative_algorithm": "radix"},
    ],
)
def test_window_pool_without_cache_and_with_drafts(family_dirs, options):
    """``cache="none"`` (every window page is the request's, freed at finish) and
    speculative decoding (rejected drafts give their window pages back): the same
    tokens as transformers, nothing leaked."""
    folder = family_dirs("gemma3")
    hf = load_hf(folder)
    rng = np.random.default_rng(4)
    motif = rng.integers(4, 512, 6).tolist()
    prompts = [motif * 6 + rng.integers(4, 512, 5).tolist(), prompts_for(5)[0]]
    want = [hf_cached_greedy(hf, p, GEN) for p in prompts]
    eng = Engine(str(folder), dtype="float64", num_pages=512, max_running_requests=4,
                 chunked_prefill_size=16, **options)  # fmt: skip
    assert eng.scheduler.kv.window is not None
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        assert [r.token_ids for r in eng.generate(prompts, sp)] == want
        eng.check_idle()
    eng.close()


def test_full_layers_read_a_long_shared_prefix_once(family_dirs):
    """Four requests sharing an 80-token prefix decode together: the full layers'
    backend reads the prefix once (cascade), the window pool's per request; the tokens
    are transformers'."""
    folder = family_dirs("gemma2")
    hf = load_hf(folder)
    rng = np.random.default_rng(6)
    shared = rng.integers(4, 512, 80).tolist()
    prompts = [shared + rng.integers(4, 512, 5 + i).tolist() for i in range(4)]
    want = [hf_cached_greedy(hf, p, GEN) for p in prompts]
    eng = Engine(str(folder), dtype="float64", num_pages=1024, max_running_requests=4)
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    eng.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0))
    full = eng.runner.backend.full
    groups = []
    plan = full._cascade_groups

    def spy(*args):
        out = plan(*args)
        groups.append(len(out[0]))
        return out

    full._cascade_groups = spy
    assert [r.token_ids for r in eng.generate(prompts, sp)] == want
    assert max(groups) > 0, "the full layers never read the shared prefix once"
    eng.check_idle()
    eng.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_window_pool_equals_one_pool(family_dirs, kv_cache_dtype):
    """The same tokens with and without the window pool, quantized KV included (the
    dummy page's keys get weight zero, so nothing the window pool changes is read)."""
    folder = family_dirs("gemma3")
    prompts = prompts_for(7)
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    outs = []
    for pool in (0, None):
        eng = Engine(str(folder), dtype="float32", num_pages=512, page_size=4,
                     kv_cache_dtype=kv_cache_dtype, sliding_pool_pages=pool,
                     chunked_prefill_size=16)  # fmt: skip
        assert (eng.runner.window_pool is None) == (pool == 0)
        outs.append([r.token_ids for r in eng.generate(prompts + prompts, sp)])
        eng.check_idle()
        eng.close()
    assert outs[0] == outs[1]


def test_window_pool_refuses_the_native_tree_and_kv_events(family_dirs):
    folder = str(family_dirs("gemma2"))
    with pytest.raises(ValueError, match="native radix tree keeps no window pages"):
        Engine(folder, dtype="float64", num_pages=128, radix_impl="native")
    eng = Engine(folder, dtype="float64", num_pages=128)
    with pytest.raises(ValueError, match="window pages"):
        eng.scheduler.record_kv_events()
    eng.close()
