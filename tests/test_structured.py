"""Structured output through the Engine: every sampled output follows its constraint,
masks batched equal masks row by row, retraction and n > 1 keep outputs valid,
jump-forward changes no token where tokenization is unique and no text where it
retokenizes, forced tokens are cached, compiled grammars are reused, and a
token the grammar rejects fails that request only.

Tiny random float64 models with real tokenizers: SmolLM2's byte-level BPE
(merges like ``"name`` make the jump-forward boundary rule matter) and a
one-token-per-character tokenizer (every string has exactly one tokenization).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams, StructuredOutput
from radixserve.layers import cpu_kernels
from radixserve.protocol import GrammarSpec
from radixserve.structured import xgrammar
from radixserve.worker.grammar import GrammarCache, GrammarSlots, apply_bitmask_torch
from tests.helpers.tiny_models import make_tiny_model, use_char_tokenizer, use_tokenizer_of

SCHEMA = {
    "type": "object",
    "properties": {
        "employee_full_name": {"type": "string", "maxLength": 6},
        "years_of_experience": {"type": "integer", "minimum": 0, "maximum": 99},
        "department": {"enum": ["sales", "research", "support"]},
        "is_currently_employed": {"type": "boolean"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": [
        "employee_full_name",
        "years_of_experience",
        "department",
        "is_currently_employed",
        "skills",
    ],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
# Sums and products of small numbers, one level of parentheses (bounded, so a
# random model's output always completes).
EBNF = r"""
root ::= term (("+" | "-") term){0,2}
term ::= factor ("*" factor){0,2}
factor ::= [0-9] | [1-9] [0-9] | "(" inner ")"
inner ::= [0-9] (("+" | "-" | "*") [0-9]){0,2}
"""
_FACTOR = r"(?:[0-9]|[1-9][0-9]|\([0-9](?:[-+*][0-9]){0,2}\))"
_TERM = rf"{_FACTOR}(?:\*{_FACTOR}){{0,2}}"
EBNF_AS_REGEX = rf"{_TERM}(?:[-+]{_TERM}){{0,2}}"


def check(so: StructuredOutput, text: str) -> None:
    if so.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(so.spec))
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif so.kind == "regex":
        assert re.fullmatch(so.spec, text), text
    else:
        assert re.fullmatch(EBNF_AS_REGEX, text), text


# Bounded constraints: a random model's output always completes (json_object is
# checked on SmolLM2 below).
CONSTRAINTS = [
    StructuredOutput.json(SCHEMA),
    StructuredOutput.regex(REGEX),
    StructuredOutput.grammar(EBNF),
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, smollm2_cache_dir):
    from radixserve.models.source import resolve_model

    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny-bpe"), "llama", seed=3, tokenizer=False,
        vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    return use_tokenizer_of(folder, resolve_model("smollm2", smollm2_cache_dir).folder)


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny-chars"), "llama", seed=4, tokenizer=False, vocab_size=128
    )
    return use_char_tokenizer(folder)


def engine(folder, **kw) -> Engine:
    kw.setdefault("num_pages", 2048)
    kw.setdefault("max_running_requests", 16)
    return Engine(str(folder), dtype="float64", warmup=False, **kw)


@pytest.fixture(scope="module")
def bpe_engine(bpe_dir):
    return engine(bpe_dir)


def test_every_sampled_output_follows_its_constraint(bpe_engine):
    prompts = ["Alice is an engineer.", "Hello there", "{"]
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=11 * i, n=4, structured=so)
        for i, so in enumerate(CONSTRAINTS)
    ]
    for prompt in prompts:
        results = bpe_engine.generate([prompt] * len(CONSTRAINTS), params)
        for i, so in enumerate(CONSTRAINTS):
            for r in results[4 * i : 4 * i + 4]:
                assert r.finish_reason == "stop", (so.kind, r.text, r.error)
                check(so, r.text)
    bpe_engine.check_idle()


def test_n_samples_and_retraction_keep_outputs_valid(bpe_dir):
    # A pool that cannot hold every sample at once: the newest are retracted and,
    # re-admitted, rebuild their matchers by replaying what they had generated.
    eng = engine(bpe_dir, num_pages=200, decode_reserve_ratio=0.0)
    so = StructuredOutput.json(SCHEMA)
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=5, n=6, structured=so)
    results = eng.generate(["The new hire", "Our team"], params)
    assert eng.stats()["preemptions"] > 0
    for r in results:
        assert r.finish_reason == "stop", r.text
        check(so, r.text)
    assert len({r.text for r in results}) > 1  # n samples, n matchers
    eng.check_idle()


def test_masks_applied_batched_equal_masks_applied_row_by_row(bpe_engine):
    runner = bpe_engine.runner
    cache = GrammarCache(lambda: bpe_engine.tokenizer, runner.vocab_size, runner.eos_token_ids)
    slots = GrammarSlots(cache, lambda: bpe_engine.tokenizer, jump_forward=False)
    for so in CONSTRAINTS:
        cache.submit(GrammarSpec(so.key, so.kind, so.spec))
    while cache.num_pending:
        cache.wait(1.0)
        cache.poll()
    tok = bpe_engine.tokenizer
    # Six slots, four grammars, at different states (some tokens accepted).
    states = [(0, '{"employee'), (1, ""), (1, "ab"), (2, "(1"), (0, ""), (1, "abc@x")]
    batch = []
    for slot, (g, text) in enumerate(states):
        params = SamplingParams(structured=CONSTRAINTS[g])
        assert slots.add(slot, params, 0, np.zeros(0, dtype=np.int32)) is None
        matcher = slots._slots[slot].matcher
        for t in tok.encode(text, add_special_tokens=False):
            assert matcher.accept_token(t)
        batch.append(slot)
    batch.insert(2, 99)  # an unconstrained row in the middle stays untouched
    vocab = runner.vocab_size
    logits = torch.randn(
        len(batch), vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    for dtype in (torch.float32, torch.float64):  # xgrammar's kernel, and the torch path
        together = logits.to(dtype).clone()
        slots.apply_masks(together, batch)
        for i, slot in enumerate(batch):
            alone = logits[i : i + 1].to(dtype).clone()
            slots.apply_masks(alone, [slot])
            assert torch.equal(together[i : i + 1], alone), (dtype, slot)
        assert torch.equal(together[2], logits[2].to(dtype))
        masked = torch.isinf(together).sum(dim=1)
        assert all(masked[i] > 0 for i in range(len(batch)) if i != 2)
    # Every implementation agrees: the native kernel (what the CPU runs), torch's,
    # and xgrammar's own.
    rows, bitmask = slots.fill_masks(batch)
    ref = logits.float().clone()
    apply_bitmask_torch(ref, bitmask, rows, vocab)
    theirs = logits.float().clone()
    xgrammar().apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(ref, theirs)
    if cpu_kernels.bitmask_ok(ref):
        for dtype in (torch.float32, torch.float64):
            native, want = logits.to(dtype).clone(), logits.to(dtype).clone()
            cpu_kernels.apply_token_bitmask(native, bitmask, rows)
            apply_bitmask_torch(want, bitmask, rows, vocab)
            assert torch.equal(native, want)
            assert torch.equal(torch.isinf(native), torch.isinf(ref))


def test_jump_forward_changes_no_token_where_tokenization_is_unique(char_dir):
    so = StructuredOutput.json(SCHEMA)
    params = SamplingParams(max_tokens=200, temperature=0.0, structured=so)
    prompts = ["Alice:", "Bob works in research"]
    runs = {}
    for jump in (False, True):
        eng = engine(char_dir, jump_forward=jump)
        runs[jump] = (eng.generate(prompts, params), eng.stats()["steps"])
        eng.check_idle()
    (plain, plain_steps), (jumped, jumped_steps) = runs[False], runs[True]
    for a, b in zip(plain, jumped):
        assert a.finish_reason == b.finish_reason == "stop"
        assert a.token_ids == b.token_ids
        check(so, b.text)
    # The keys are forced: long runs of characters come in one step each.
    assert plain_steps >= 2 * jumped_steps


def test_jump_forward_retokenizes_the_boundary_and_caches_the_forced_tokens(bpe_dir):
    so = StructuredOutput.json(SCHEMA)
    params = SamplingParams(max_tokens=200, temperature=0.0, structured=so)
    prompt = "Alice has 7 years of experience in research."
    out = {}
    for jump in (False, True):
        eng = engine(bpe_dir, jump_forward=jump)
        [out[jump]] = eng.generate(prompt, params)
        check(so, out[jump].text)
        if jump:
            # The forced tokens went into the radix tree with the rest of the output.
            ids = eng.inputs.to_ids(prompt=prompt) + out[jump].token_ids
            [again] = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
            assert again.usage.cached_tokens == len(ids) - 1
        eng.check_idle()
    assert json.loads(out[True].text).keys() == json.loads(out[False].text).keys()
    # Forced keys tokenize canonically ("employee" merged): fewer tokens for the same keys.
    assert len(out[True].token_ids) < len(out[False].token_ids)


def test_jump_forward_keeps_the_text_on_a_real_model(smollm2_cache_dir):
    """SmolLM2 follows the schema with its own (non-canonical) tokenization; with
    jump-forward the forced parts are retokenized, and the text is the same."""
    schema = {
        "type": "object",
        "properties": {
            "employee_full_name": {"type": "string", "maxLength": 20},
            "years_of_experience": {"type": "integer"},
        },
        "required": ["employee_full_name", "years_of_experience"],
    }
    so = StructuredOutput.json(schema)
    chat = [{"role": "user", "content": "Alice Smith has 7 years of experience. As JSON:"}]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured=so)
    out = {}
    for jump in (False, True):
        eng = Engine("smollm2", cache_dir=smollm2_cache_dir, warmup=False, jump_forward=jump,
                     max_running_requests=2, num_pages=1024)  # fmt: skip
        [out[jump]] = eng.generate([chat], params)
        out[jump, "steps"] = eng.stats()["steps"]
        if jump:
            any_object = StructuredOutput.json_object()
            ask = 'Write a JSON object with one key, "name", whose value is "Alice".'
            [obj] = eng.generate([[{"role": "user", "content": ask}]],
                                 SamplingParams(max_tokens=60, temperature=0.0,
                                                structured=any_object))  # fmt: skip
            assert obj.finish_reason == "stop"
            check(any_object, obj.text)
        eng.close()
    assert out[True].text == out[False].text
    check(so, out[True].text)
    assert out[True, "steps"] < out[False, "steps"]


def test_compiled_grammars_are_reused_from_an_lru(char_dir):
    eng = engine(char_dir, grammar_cache_size=1)
    cache = eng.runner.grammar_cache
    a, b = StructuredOutput.regex("[a-c]{3}"), StructuredOutput.regex("[x-z]{3}")

    def run(so):
        [r] = eng.generate("p", SamplingParams(max_tokens=10, temperature=0.0, structured=so))
        check(so, r.text)

    run(a)
    run(a)
    assert cache.compiled == 1  # the second request found it compiled
    run(b)  # evicts a (one grammar cached)
    run(a)
    assert cache.compiled == 3
    # Two requests with one grammar at once compile it once.
    eng.generate(["p", "q"], SamplingParams(max_tokens=10, temperature=0.0, structured=b))
    assert cache.compiled == 4
    eng.check_idle()


def test_bad_constraints_are_refused_before_anything_is_scheduled(char_dir):
    eng = engine(char_dir)
    bad = [
        (StructuredOutput.json('{"type": "no such type"}'), "invalid JSON schema"),
        (StructuredOutput.regex("(unclosed"), "invalid regex"),
        (StructuredOutput.grammar("root ::= missing_rule"), "invalid grammar"),
        (StructuredOutput("json_schema", "[1, 2]"), "must be an object or a boolean"),
    ]
    good = SamplingParams(max_tokens=2)
    for so, message in bad:
        with pytest.raises(ValueError, match=message):
            eng.generate(["a", "b"], [good, SamplingParams(max_tokens=2, structured=so)])
        assert eng.scheduler.num_waiting == 0
    with pytest.raises(ValueError, match="kind must be one of"):
        SamplingParams(structured={"kind": "xml", "spec": ""})
    eng.check_idle()


def test_a_rejected_token_fails_that_request_only(char_dir, monkeypatch):
    """With the masks off the model samples what the grammar cannot take: the
    matcher's rejection ends that request with an error; the others finish and
    no page leaks."""
    eng = engine(char_dir)
    monkeypatch.setattr(GrammarSlots, "apply_masks", lambda self, logits, slots: logits)
    so = StructuredOutput.regex("q{50}")  # not what a random model writes
    results = eng.generate(
        ["hello", "world"],
        [SamplingParams(max_tokens=40, temperature=0.0, n=2, structured=so),
         SamplingParams(max_tokens=5, temperature=0.0)],
    )  # fmt: skip
    failed, fine = results[:2], results[2]
    for r in failed:
        assert r.finish_reason == "error"
        assert "the grammar rejected the sampled token" in r.error
    assert fine.finish_reason == "length" and len(fine.token_ids) == 5
    eng.check_idle()
