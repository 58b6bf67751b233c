"""Prompt programs on the in-process Engine (radixserve.program) against plain requests.

``select`` must pick what the normalized prompt logprobs, computed independently
without a cache, pick; a fork's branches must generate what independent requests
with the same context generate, after the context was computed once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from radixserve.program import BranchError, Selection
from tests.helpers.tiny_models import make_tiny_model

PAGE = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny-program"), "llama", seed=7, max_position_embeddings=512
    )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return Engine(str(tiny_dir), dtype="float64", num_pages=512, page_size=PAGE)


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    """No prefix cache: every request computes its whole prompt."""
    return Engine(str(tiny_dir), dtype="float64", num_pages=512, cache="none")


def normalized_logprob(engine: Engine, context: list[int], choice: list[int]) -> float:
    """The mean logprob of ``choice``'s tokens after ``context``: the whole string
    scored from position 0 in one request."""
    sp = SamplingParams(max_tokens=0, prompt_logprobs=0)
    [r] = engine.generate([context + choice], sp)
    lps = [e.logprob for e in r.prompt_logprobs[len(context) :]]
    assert len(lps) == len(choice)
    return sum(lps) / len(lps)


def test_select_picks_the_highest_normalized_logprob(eng, oracle):
    choices = [" the library", " a module of the standard library", " it", " none"]
    tok = {c: eng.inputs.tokenize(c, add_special_tokens=False) for c in choices}
    for question in ("The os module is", "Which function opens a file? Answer:"):
        s = eng.program(question)
        context = s.token_ids
        assert context == eng.inputs.tokenize(question)  # with BOS, as generate would
        picked = s.select("answer", choices)
        want = [normalized_logprob(oracle, context, tok[c]) for c in choices]
        sel = s.results["answer"]
        assert isinstance(sel, Selection)
        assert sel.scores == pytest.approx(want, rel=1e-9, abs=1e-9)
        assert picked == s["answer"] == choices[int(np.argmax(want))]
        assert s.token_ids == context + tok[picked]
        eng.check_idle()


def test_fork_gen_equals_independent_requests_and_shares_the_context(eng, oracle):
    rng = np.random.default_rng(3)
    s = eng.program(input_ids=rng.integers(4, 512, 41).tolist())
    s += " and then the next part of the context"
    context = s.token_ids
    branches = s.fork(3)
    tails = [rng.integers(4, 512, k).tolist() for k in (1, 3, 6)]
    for b, tail in zip(branches, tails):
        b += tail
    greedy = dict(max_tokens=9, temperature=0.0, ignore_eos=True)
    texts = branches.gen("step", **greedy)

    want = oracle.generate([context + t for t in tails], SamplingParams(**greedy))
    assert [b.results["step"].token_ids for b in branches] == [w.token_ids for w in want]
    assert texts == branches.values("step") == [w.text for w in want]
    for b, tail, w in zip(branches, tails, want):
        assert b.token_ids == context + tail + w.token_ids
        # The fork's prefill computed the context once; every branch found it cached.
        assert b.results["step"].usage.cached_tokens >= len(context) // PAGE * PAGE
    assert s.token_ids == context  # the parent is unchanged

    # Per-branch functions (one after another on the Engine): gen, then select.
    def finish(b):
        b += " so"
        b.gen("more", max_tokens=4, temperature=0.0, ignore_eos=True)
        return b.select("end", [".", "!"])

    ends = branches.run(finish)
    assert ends == branches.values("end") and set(ends) <= {".", "!"}
    eng.check_idle()


def test_a_failing_branch_names_itself_and_the_variable(eng):
    s = eng.program("Short context")
    branches = s.fork(3)
    branches[1] += [5] * 600  # beyond the model's context
    with pytest.raises(BranchError) as info:
        branches.gen("x", max_tokens=2)
    assert (info.value.branch, info.value.name) == (1, "x")
    assert isinstance(info.value.error, ValueError) and "tokens" in str(info.value.error)
    # Outside branches the error is raised as is, and the state stays as it was.
    before = branches[1].token_ids
    with pytest.raises(ValueError, match="tokens"):
        branches[1].gen("y", max_tokens=2)
    assert branches[1].token_ids == before and "y" not in branches[1]
    eng.check_idle()


def test_chat_program_keeps_the_templates_tokens(eng, oracle):
    system = {"role": "system", "content": "Be brief."}
    s = eng.program(messages=[system])
    assert s.token_ids == eng.inputs.tokenize(messages=[system], add_generation_prompt=False)
    s.user("Name a module.")
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    text = s.assistant_gen("reply", **greedy)
    # What a plain chat request generates, after the same rendering.
    [want] = oracle.generate([s.messages[:2]], SamplingParams(**greedy))
    assert text == s["reply"] == want.text
    assert s.messages[-1] == {"role": "assistant", "content": text}
    # After each message the context is the template's rendering of the conversation.
    assert s.token_ids == eng.inputs.tokenize(messages=s.messages, add_generation_prompt=False)
    s.user("Another?")
    assert s.token_ids == eng.inputs.tokenize(messages=s.messages, add_generation_prompt=False)
    with pytest.raises(ValueError, match="chat program"):
        eng.program("plain").user("hi")
    eng.check_idle()
