"""The in-process Engine against HF transformers on tiny float64 models.

Greedy tokens must equal HF's whatever the cache mode, page size, chunking,
and KV pressure (eviction and retraction); the idle invariant holds after
every test.
"""

from __future__ import annotations

import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from tests.helpers.tiny_models import hf_greedy, load_hf_float64, make_tiny_model

MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # 2048 positions so that 1000-token shared prefixes fit.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-engine"), "llama", seed=5, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return load_hf_float64(tiny_dir)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(4, 512, 100).tolist()  # >= 64 shared tokens: cascade decode
    return [
        shared + rng.integers(4, 512, 9).tolist(),
        shared + rng.integers(4, 512, 23).tolist(),
        shared[:17] + rng.integers(4, 512, 5).tolist(),
        rng.integers(4, 512, 31).tolist(),
    ]


@pytest.fixture(scope="module")
def expected(hf, prompts):
    return [hf_greedy(hf, p, MAX_NEW)[0] for p in prompts]


def engine(tiny_dir, **kw) -> Engine:
    kw.setdefault("dtype", "float64")
    kw.setdefault("num_pages", 2048)
    return Engine(str(tiny_dir), **kw)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("cache", ["radix", "none"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [2048, 16])
def test_greedy_equals_hf(tiny_dir, prompts, expected, cache, page_size, chunk):
    eng = engine(tiny_dir, cache=cache, page_size=page_size, chunked_prefill_size=chunk)
    # Twice: the second round runs on a warm cache (cache early + finished KV).
    for _ in range(2):
        results = eng.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
        assert all(r.finish_reason == "length" for r in results)
        eng.check_idle()
    if cache == "none":
        assert eng.stats()["hit_tokens"] == 0
    else:
        assert eng.stats()["hit_tokens"] > 0


def test_greedy_equals_hf_with_a_prefill_budget_while_decoding(tiny_dir, prompts, expected):
    """Prompts prefilled a page a step beside decodes (``decode_step_tokens``) or in
    whole chunks: the same greedy tokens."""
    for budget in (8, 0):
        eng = engine(tiny_dir, page_size=4, chunked_prefill_size=32, decode_step_tokens=budget)
        results = eng.generate(prompts, GREEDY)
        assert [r.token_ids for r in results] == expected
        eng.check_idle()


def test_greedy_equals_hf_under_kv_pressure(tiny_dir, prompts, expected):
    """A pool that fits about two requests: eviction and retraction must not change tokens."""
    eng = engine(tiny_dir, page_size=4, num_pages=40, decode_reserve_ratio=0.0)
    results = eng.generate(prompts * 2, GREEDY)
    assert [r.token_ids for r in results] == expected * 2
    assert eng.stats()["preemptions"] > 0
    eng.check_idle()


def test_shared_prefix_hits(tiny_dir):
    rng = np.random.default_rng(3)
    prefix = rng.integers(4, 512, 256).tolist()
    for cache, page_size, want in (("radix", 1, 256), ("radix", 16, 256), ("none", 1, 0)):
        eng = engine(tiny_dir, cache=cache, page_size=page_size)
        sp = SamplingParams(max_tokens=2, temperature=0.0)
        eng.generate([prefix + [7, 8, 9]], sp)
        [r] = eng.generate([prefix + [10, 11]], sp)
        assert r.usage.cached_tokens == want
        assert r.usage.prompt_tokens == 258
        eng.check_idle()


def test_explain_the_cache_and_a_request_that_asks(tiny_dir):
    eng = engine(tiny_dir, page_size=16)
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    text = "The radix tree keeps every prompt it has seen, page by page, for the next one."
    eng.generate(text, sp)
    report = eng.explain_cache(text[:30] + " and then something else")
    assert report["stop"] == "partial_page" or report["stop"] == "diverged"
    assert report["miss"]["most_common"]["text"] and report["reason"]
    assert eng.dashboard()["tree"]["nodes"][0]["label"]
    [r] = eng.generate(text, SamplingParams(max_tokens=2, temperature=0.0, explain=True))
    assert r.usage.explain["hit_tokens"] == r.usage.cached_tokens > 0
    assert r.usage.explain["namespace"] == {"cache_salt": None, "adapter": None}
    eng.check_idle()


def test_new_shared_prefix_computed_once(tiny_dir):
    """32 requests sharing one new 1000-token prefix, submitted at once."""
    rng = np.random.default_rng(4)
    prefix = rng.integers(4, 512, 1000).tolist()
    batch = [prefix + rng.integers(4, 512, 30).tolist() for _ in range(32)]
    eng = engine(tiny_dir, num_pages=40000)
    results = eng.generate(batch, SamplingParams(max_tokens=2, temperature=0.0))
    hit = sum(r.usage.cached_tokens for r in results)
    optimal = 31 * 1000
    assert hit >= 0.98 * optimal
    eng.check_idle()


def test_stop_strings_seeds_and_n(tiny_dir):
    eng = engine(tiny_dir)
    prompt = "The quick brown fox"
    [base] = eng.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert len(base.text) > 6
    stop = base.text[3:6]
    [cut] = eng.generate(
        prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.index(stop)]
    assert len(cut.token_ids) < len(base.token_ids)

    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    [a] = eng.generate(prompt, seeded)
    # The same seed gives the same text whatever else is in the batch.
    b, _ = eng.generate([prompt, "Another prompt entirely"], [seeded, seeded])
    assert a.token_ids == b.token_ids
    many = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4))
    assert [r.index for r in many] == [0, 1, 2, 3]
    assert len({tuple(r.token_ids) for r in many}) > 1
    # The prompt is computed once: the other samples hit all of it but its last token.
    prompt_len = many[0].usage.prompt_tokens
    assert sorted(r.usage.cached_tokens for r in many)[1:] == [prompt_len - 1] * 3
    eng.check_idle()


def test_abort_and_flush_while_busy(tiny_dir, prompts):
    calm = engine(tiny_dir, page_size=4).generate(prompts, GREEDY)
    eng = engine(tiny_dir, page_size=4)
    sched = eng.scheduler
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finish: dict[str, str] = {}
    step = 0
    while sched.has_work():
        for out in sched.step(eng.runner.step):
            assert out.rid not in finish, "output after finish"
            tokens[out.rid] += out.token_ids
            if out.finish_reason is not None:
                finish[out.rid] = out.finish_reason
        if step == 2:
            assert sched.abort_request("r1")
            protected = sched.cache.protected_pages
            freed = eng.flush_cache()
            assert sched.cache.protected_pages == protected and sched.cache.evictable_pages == 0
            assert freed > 0  # the aborted request's own KV was cached, unlocked
        step += 1
    assert finish == {"r0": "length", "r1": "abort", "r2": "length", "r3": "length"}
    assert 0 < len(tokens["r1"]) < MAX_NEW
    assert tokens["r1"] == calm[1].token_ids[: len(tokens["r1"])]
    for i in (0, 2, 3):
        assert tokens[f"r{i}"] == calm[i].token_ids  # the abort and flush change no one else
    eng.check_idle()


def test_bad_input_raises_and_changes_nothing(tiny_dir):
    eng = engine(tiny_dir)
    with pytest.raises(ValueError, match="context"):
        eng.generate([[5] * 3000], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([[5, 99999]], GREEDY)
    with pytest.raises(ValueError, match="chat template"):
        eng.generate([[{"role": "user", "content": "hi"}]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    [r] = eng.generate("still works", SamplingParams(max_tokens=3, temperature=0.0))
    assert r.finish_reason in ("stop", "length")
    eng.check_idle()


# Prints each tool's function name before the chat, as real templates print definitions.
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}.\n"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "find_flights"}},
]


def test_tool_definitions_reach_the_prompt(tiny_dir):
    eng = engine(tiny_dir)
    eng.tokenizer.chat_template = TOOLS_TEMPLATE
    chat = [{"role": "user", "content": "Rome?"}]
    ids = eng.inputs.to_ids(messages=chat, tools=TOOLS)
    rendered = eng.tokenizer.apply_chat_template(
        chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert rendered == "tools: get_weather find_flights.\nuser: Rome?\nassistant:"
    assert ids == eng.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(ids) > len(eng.inputs.to_ids(messages=chat))
    # generate(tools=...) runs that very prompt, for each chat given.
    with_tools = eng.generate([chat, chat], GREEDY, tools=TOOLS)
    [same] = eng.generate([ids], GREEDY)
    for r in with_tools:
        assert (r.token_ids, r.usage.prompt_tokens) == (same.token_ids, len(ids))
    with pytest.raises(ValueError, match="tools go with chat messages only"):
        eng.generate([chat, "a text prompt"], GREEDY, tools=TOOLS)
    eng.check_idle()


def test_seeded_output_survives_retraction(tiny_dir, prompts):
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=11, ignore_eos=True)
    calm = engine(tiny_dir).generate(prompts, sp)
    tight = engine(tiny_dir, page_size=4, num_pages=40, decode_reserve_ratio=0.0)
    squeezed = tight.generate(prompts * 2, sp)
    assert tight.stats()["preemptions"] > 0
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in calm] * 2
    tight.check_idle()


def test_an_urgent_request_preempts_at_once_and_every_output_equals_hf(tiny_dir, hf, prompts):
    """Priority policy, every slot taken (two decodes, a long prompt mid-way through
    its chunks): an urgent request has its first token after one step, its own
    prefill's; the preempted prompt resumes from its cached chunks; every request's
    greedy tokens are HF's."""
    e = engine(tiny_dir, schedule_policy="priority", max_running_requests=3, page_size=4,
               chunked_prefill_size=16)  # fmt: skip
    s = e.scheduler
    urgent = np.random.default_rng(1).integers(4, 512, 12).tolist()
    reqs = {"low2": (prompts[2], 5), "low3": (prompts[3], 5)}
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in s.step(e.runner.step):
            tokens.setdefault(out.rid, []).extend(out.token_ids)

    for rid, (p, level) in reqs.items():
        s.add_request(rid, p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                             ignore_eos=True, priority=level))  # fmt: skip
    while not all(rid in tokens for rid in reqs):
        step()
    reqs["long"] = (prompts[1], 3)  # 123 tokens: 8 chunks
    reqs["urgent"] = (urgent, -1)
    for rid in ("long", "urgent"):
        p, level = reqs[rid]
        s.add_request(rid, p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                             ignore_eos=True, priority=level))  # fmt: skip
        if rid == "long":
            step(), step()
            assert s.chunked is not None and s.chunked.rid == "long"
    step()
    assert tokens.get("urgent"), "the urgent request waited"
    assert s.num_priority_preemptions == 1
    # The preempted prompt's chunks wait in the tree for it.
    assert s.cache.peek_prefix(np.asarray(prompts[1], dtype=np.int32)) >= 2 * 16
    while s.has_work():
        step()
    for rid, (p, _) in reqs.items():
        assert tokens[rid] == hf_greedy(hf, p, MAX_NEW)[0], rid
    e.check_idle()
