"""Speculative decoding with structured output, through the Engine on a tiny float64
model (one token per character).

Greedy outputs with a grammar (JSON schema, regex, EBNF) are those of the same Engine
without speculation, for both drafters, with drafts proposed and accepted; a draft the
grammar rejects is cut before verification (``GrammarSlots.walk_drafts``); sampling
with a grammar and drafts gives only outputs the grammar accepts; an abort while a
verification is in flight leaves no page behind.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from radixserve import Engine, SamplingParams, StructuredOutput
from radixserve.sampling_params import SamplingParams as Params
from tests.helpers.tiny_models import make_tiny_model, use_char_tokenizer

MAX_NEW = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["ab", "abc", "b"]}, "maxItems": 4},
    },
    "required": ["name", "tags"],
}
REGEX = r"(ab|abc|bca){3,12}"
EBNF = r"""
root ::= item (", " item){2,8}
item ::= "yes" | "no" | "maybe"
"""
CONSTRAINTS = [
    StructuredOutput.json(SCHEMA),
    StructuredOutput.regex(REGEX),
    StructuredOutput.grammar(EBNF),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return use_char_tokenizer(
        make_tiny_model(
            tmp_path_factory.mktemp("tiny-spec-so"), "llama", seed=5, max_position_embeddings=1024
        )
    )


PROMPTS = ["yes, no, abcabc, ab, yes, no", '{"name": "ab", "tags": ["ab"]} abcabc']


def engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", "float64")
    kw.setdefault("num_pages", 512)
    kw.setdefault("warmup", False)
    return Engine(str(folder), **kw)


def run(eng: Engine, temperature: float = 0.0, seed: int | None = None) -> list:
    """Every prompt under every constraint, twice (the second time the tree holds
    the first's output: radix drafts)."""
    out = []
    for _ in range(2):
        for so in CONSTRAINTS:
            params = SamplingParams(
                max_tokens=MAX_NEW, temperature=temperature, seed=seed, structured=so
            )
            res = eng.generate(PROMPTS, params)
            out.append([(r.token_ids, r.text, r.finish_reason) for r in res])
    eng.check_idle()
    return out


@pytest.fixture(scope="module")
def plain(tiny_dir):
    with engine(tiny_dir) as eng:
        return run(eng)


@pytest.mark.parametrize("algorithm", ["ngram", "radix"])
def test_greedy_outputs_with_a_grammar_equal_those_without_speculation(tiny_dir, plain, algorithm):
    with engine(tiny_dir, speculative_algorithm=algorithm, speculative_min_match=1) as eng:
        assert run(eng) == plain
        stats = eng.stats()
    assert stats["spec_verifications"] > 0
    assert stats["spec_accepted_tokens"] > 0
    if algorithm == "radix":  # the replays are drafted from the first outputs
        assert stats["spec_accepted_tokens"] >= 10


def test_sampling_with_a_grammar_and_drafts_follows_the_grammar(tiny_dir):
    with engine(tiny_dir, speculative_algorithm="radix", speculative_min_match=1) as eng:
        for seed in range(3):
            for regex_out in run(eng, temperature=1.0, seed=seed)[1::3]:
                for _, text, reason in regex_out:
                    if reason == "stop":
                        assert re.fullmatch(REGEX, text), text
                    else:
                        assert re.fullmatch(r"(ab|abc|bca)*(a|ab|abc|b|bc)?", text), text
        assert eng.stats()["spec_verifications"] > 0


def test_a_draft_the_grammar_rejects_is_cut(tiny_dir):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from radixserve.structured import build_grammar
    from radixserve.worker.grammar import GrammarSlots

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    vocab = 512
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[2])
    so = StructuredOutput.regex(REGEX)
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(so))

    class Cache:
        vocab_size = vocab

        def get(self, key):
            return compiled

    slots = GrammarSlots(Cache(), lambda: tok, jump_forward=False)
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert slots.add(7, Params(structured=so), 0, np.asarray(ids("ab"), dtype=np.int32)) is None
    # "ab" then "cab" is accepted, "x" is not: three drafts kept of five.
    a, bitmask = slots.walk_drafts(7, ids("cabxa"))
    assert a == 3 and bitmask.shape[0] == 4
    from radixserve.worker.grammar import unpack_bitmask

    allowed = unpack_bitmask(bitmask, vocab)
    assert allowed[0, ids("c")[0]] and allowed[0, ids("a")[0]] and not allowed[0, ids("x")[0]]
    assert allowed[3, ids("c")[0]] and not allowed[3, ids("x")[0]]  # after "abcab"
    # The matcher is where it was: the same walk gives the same cut.
    assert slots.walk_drafts(7, ids("cabxa"))[0] == 3
    assert slots.walk_drafts(7, ids("x"))[0] == 0


def test_abort_while_a_grammar_request_is_verified_leaves_nothing_behind(tiny_dir, plain):
    so = StructuredOutput.regex(REGEX)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured=so)
    with engine(tiny_dir, speculative_algorithm="radix", page_size=4) as eng:
        first = eng.generate(PROMPTS[:1], params)[0]  # the replays below are drafted
        sched = eng.scheduler
        prompt = eng.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
        for rid in ("r0", "r1", "r2"):
            sched.add_request(rid, prompt, params)
        aborted = []

        def step(batch):
            # Abort r1 once its drafts are in a step, after the step was planned.
            if not aborted and any(r.num_drafts for r in batch.reqs):
                for q in sched.running:
                    if q.rid == "r1" and len(q.spec.draft):
                        aborted.append(sched.abort_request("r1"))
            return eng.runner.step(batch)

        tokens = {"r0": [], "r1": [], "r2": []}
        finish = {}
        while sched.has_work():
            for out in sched.step(step):
                tokens[out.rid] += out.token_ids
                if out.finish_reason is not None:
                    finish[out.rid] = out.finish_reason
        assert aborted == [True] and finish["r1"] == "abort"
        assert tokens["r0"] == tokens["r2"] == first.token_ids
        eng.check_idle()
