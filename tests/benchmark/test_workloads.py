"""Workload shapes: request counts, exact lengths, what is shared and what is not."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from radixserve.benchmark.runner import arrival_times
from radixserve.benchmark.targets import compare_flags
from radixserve.benchmark.workloads import (
    RECORDS,
    TokenSource,
    copy,
    few_shot,
    few_shot_score,
    json_extract,
    multi_turn,
    shared_prefix,
    tree,
)
from radixserve.structured import build_grammar


def src(seed: int = 0) -> TokenSource:
    return TokenSource.random(1000, seed, exclude=[0, 1, 2])


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    w = shared_prefix(src(), groups=3, prompts=4, system_len=20, question_len=5, output_len=7)
    assert w.num_requests == len(w.roots) == 12
    by_group: dict[str, list[list[int]]] = {}
    for r in w.roots:
        assert len(r.tokens) == 25 and r.max_tokens == 7 and not r.children
        assert not {0, 1, 2} & set(r.tokens)  # special ids excluded
        by_group.setdefault(r.key.split("-")[0], []).append(r.tokens)
    systems = {g: {tuple(t[:20]) for t in ts} for g, ts in by_group.items()}
    assert (
        all(len(s) == 1 for s in systems.values()) and len({*map(frozenset, systems.values())}) == 3
    )
    ordered = shared_prefix(
        src(), groups=3, prompts=4, system_len=20, question_len=5, order="ordered"
    )
    assert [r.key for r in ordered.roots][:4] == ["g0-p0", "g0-p1", "g0-p2", "g0-p3"]
    assert [r.key for r in w.roots] != [r.key for r in ordered.roots]  # shuffled


def test_multi_turn_is_a_chain_of_user_messages():
    w = multi_turn(src(), conversations=2, turns=3, user_len_min=5, user_len_max=9, answer="long")
    assert w.num_requests == 6
    for root in w.roots:
        chain = list(root.walk())
        assert len(chain) == 3 and all(len(n.children) <= 1 for n in chain)
        assert all(5 <= len(n.tokens) <= 9 and n.max_tokens == 256 for n in chain)
    assert w.max_prompt_len() >= 3 * (5 + 256)


def test_few_shot_shares_examples_per_subject():
    w = few_shot(src(), subjects=2, questions=3, shots=4, example_len=6, question_len=2)
    assert w.num_requests == 6 and all(len(r.tokens) == 26 and r.max_tokens == 1 for r in w.roots)
    assert [r.key for r in w.roots][:2] == ["s0-q0", "s1-q0"]  # subjects interleaved
    assert w.roots[0].tokens[:24] == w.roots[2].tokens[:24] != w.roots[1].tokens[:24]


def test_few_shot_score_one_request_per_choice_scored_from_the_choice():
    w = few_shot_score(
        src(),
        subjects=2,
        questions=3,
        shots=2,
        example_len=5,
        question_len=4,
        choices=4,
        choice_len=3,
    )
    assert w.name == "few-shot-score" and w.scored
    assert w.num_requests == len(w.roots) == 2 * 3 * 4
    assert set(w.answers) == {f"s{s}-q{q}" for s in range(2) for q in range(3)}
    assert all(0 <= a < 4 for a in w.answers.values())
    # Questions interleaved by subject; a question's choices sent one after the other.
    assert [r.key for r in w.roots][:6] == [
        "s0-q0-c0",
        "s0-q0-c1",
        "s0-q0-c2",
        "s0-q0-c3",
        "s1-q0-c0",
        "s1-q0-c1",
    ]
    for i in range(0, len(w.roots), 4):
        group = w.roots[i : i + 4]
        head = group[0].tokens[: group[0].score.start]
        assert {n.score.question for n in group} == {group[0].key.rsplit("-", 1)[0]}
        assert [n.score.choice for n in group] == [0, 1, 2, 3]
        for n in group:
            assert n.score.start == 2 * 5 + 4 == len(head)  # context + question
            assert n.tokens[: n.score.start] == head  # the same context and question
            assert 1 <= len(n.tokens) - n.score.start <= 3  # the choice
            assert n.max_tokens == 1 and not n.children
        assert len({tuple(n.tokens[n.score.start :]) for n in group}) == 4  # distinct choices
    # The context is shared within a subject, not across subjects.
    s0 = [r for r in w.roots if r.key.startswith("s0-")]
    s1 = [r for r in w.roots if r.key.startswith("s1-")]
    assert all(r.tokens[:10] == s0[0].tokens[:10] for r in s0)
    assert s1[0].tokens[:10] != s0[0].tokens[:10]
    assert len({tuple(r.tokens[10:14]) for r in s0}) == 3  # one question each
    assert not few_shot(src(), subjects=1, questions=1).scored


def test_tree_has_b_to_the_d_leaves():
    w = tree(src(), trees=2, depth=3, branches=2, root_len=10, branch_len=3, output_len=4)
    assert w.num_requests == 2 * (1 + 2 + 4 + 8)
    leaves = [n for r in w.roots for n in r.walk() if not n.children]
    assert len(leaves) == 16 and all(len(n.tokens) == 3 for n in leaves)


def test_real_text_source_takes_slices_of_the_text():
    text = list(range(50))
    s = TokenSource.real_text(text, seed=3)
    run = s.take(10)
    assert all((b - a) % 50 == 1 for a, b in zip(run, run[1:]))


def test_arrivals():
    assert arrival_times(3, None) == [0.0, 0.0, 0.0]
    t = arrival_times(2000, 50.0, seed=1)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert 2000 / t[-1] == pytest.approx(50.0, rel=0.1)
    with pytest.raises(ValueError):
        arrival_times(1, 0.0)


def test_json_extract_questions_share_their_document_and_carry_a_schema():
    w = json_extract(src(), documents=3, questions=6, document_len=40, question_len=5)
    assert w.name == "json-extract" and w.structured and not w.scored
    assert w.num_requests == len(w.roots) == 18
    assert [r.key for r in w.roots][:4] == ["d0-q0", "d1-q0", "d2-q0", "d0-q1"]  # interleaved
    docs: dict[str, set[tuple[int, ...]]] = {}
    for r in w.roots:
        assert len(r.tokens) == 45 and r.max_tokens == 256 and not r.children
        docs.setdefault(r.key.split("-")[0], set()).add(tuple(r.tokens[:40]))
        q = int(r.key.split("-q")[1])
        assert json.loads(r.structured.spec) == RECORDS[q % len(RECORDS)][1]
    assert all(len(d) == 1 for d in docs.values()) and len(set().union(*docs.values())) == 3
    assert len({tuple(r.tokens[40:]) for r in w.roots}) == 18  # every question its own
    # Deterministic: the same seed, the same requests.
    again = json_extract(src(), documents=3, questions=6, document_len=40, question_len=5)
    assert [(r.key, r.tokens, r.structured) for r in again.roots] == [
        (r.key, r.tokens, r.structured) for r in w.roots
    ]
    assert again.roots[0].tokens != json_extract(src(1), documents=3).roots[0].tokens[:45]


def test_json_extract_schemas_are_valid_and_have_long_constant_keys():
    kinds = set()
    for _, schema in RECORDS:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        assert schema["required"] == list(schema["properties"])
        assert schema["additionalProperties"] is False
        assert all(len(k) >= 10 and "_" in k for k in schema["properties"])
        for prop in schema["properties"].values():
            kinds.add("enum" if "enum" in prop else prop["type"])
            if prop.get("type") == "string":
                assert prop["maxLength"] <= 32
            if prop.get("type") == "integer":
                assert prop["minimum"] <= prop["maximum"]
    assert kinds == {"string", "integer", "enum", "boolean"}
    w = json_extract(src(), documents=1, questions=len(RECORDS), document_len=5)
    for r, (_, schema) in zip(w.roots, RECORDS):
        build_grammar(r.structured)  # xgrammar compiles every one
        # Keys are written in the schema's order (not sorted): the grammar generates them so.
        at = [r.structured.spec.index(f'"{k}"') for k in schema["properties"]]
        assert at == sorted(at)


def test_json_extract_instruction_names_the_fields_when_the_source_encodes():
    plain = src()
    encoded = src()
    encoded.encode = lambda text: [3 + ord(c) % 900 for c in text]
    a = json_extract(plain, documents=1, questions=2, document_len=10, question_len=3)
    b = json_extract(encoded, documents=1, questions=2, document_len=10, question_len=3)
    for x, y in zip(a.roots, b.roots):
        assert y.tokens[:13] == x.tokens and len(x.tokens) == 13
        fields = ", ".join(json.loads(y.structured.spec)["properties"])
        assert y.tokens[13:] == encoded.encode(
            f"\n\nExtract the {RECORDS[int(y.key[-1])][0]} from the document above as a "
            f"JSON object with the fields {fields}.\n"
        )


def test_compare_flags_map_values_onto_launch_flags():
    assert compare_flags("cache", "none") == ["--cache", "none"]
    assert compare_flags("page_size", "16") == ["--page-size", "16"]
    # --jump-forward/--no-jump-forward
    assert compare_flags("jump_forward", "true") == ["--jump-forward"]
    assert compare_flags("jump-forward", "False") == ["--no-jump-forward"]
    # A switch (store_true): on, or nothing.
    assert compare_flags("chat-special-tokens", "yes") == ["--chat-special-tokens"]
    assert compare_flags("chat_special_tokens", "off") == []
    with pytest.raises(SystemExit, match="true or false"):
        compare_flags("jump_forward", "sometimes")
    with pytest.raises(SystemExit, match="no --no-such-flag"):
        compare_flags("no_such_flag", "1")


def test_copy_prompts_wrap_a_document_and_recur_in_a_row():
    plain = copy(src(), documents=3, document_len=12, output_len=9, repeats=2)
    assert [n.key for n in plain.roots] == [f"doc{d}-r{r}" for d in range(3) for r in range(2)]
    docs = [n.tokens for n in plain.roots]
    assert docs[0] == docs[1] and docs[2] == docs[3] and docs[0] != docs[2]
    assert all(len(t) == 12 and n.max_tokens == 9 for t, n in zip(docs, plain.roots))
    chat = src()
    chat.encode = lambda text: [3 + ord(c) % 900 for c in text]
    chat.chat = lambda text: f"<user>{text}</user><assistant>"
    w = copy(chat, documents=1, document_len=12, output_len=9)
    (node,) = w.roots
    head = chat.encode("<user>Repeat the following text exactly, word for word, but write its ")
    assert node.tokens[: len(head)] == head
    tail = chat.encode("</user><assistant>")
    assert node.tokens[-len(tail) :] == tail
    assert len(node.tokens) - len(tail) - 12 > len(head)  # the document sits between


def test_agent_sessions_pause_between_turns_under_one_off_traffic():
    from radixserve.benchmark.workloads import AGENT_RETENTION_LEVEL, agent

    w = agent(TokenSource.random(500, seed=2), sessions=3, turns=4, system_len=10,
              context_len=20, user_len_min=5, user_len_max=7, output_len=2, pause=0.5,
              noise=4, noise_len=30, retention_s=90.0)  # fmt: skip
    sessions, noise = w.roots[:3], w.roots[3:]
    assert w.num_requests == 3 * 4 + 4 and len(noise) == 4
    system = sessions[0].tokens[:10]
    for s in sessions:
        turns = list(s.walk())
        assert [n.group for n in turns] == ["turn 1", "turn 2", "turn 3", "turn 4"]
        assert s.tokens[:10] == system and len(s.tokens) == 30 and s.delay == 0
        assert all(n.delay == 0.5 and 5 <= len(n.tokens) <= 7 for n in turns[1:])
        assert {n.retention for n in turns} == {(AGENT_RETENTION_LEVEL, 90.0)}
    # The one-offs: fresh tokens, no hint, spread evenly over the sessions' span (2 s).
    assert [n.delay for n in noise] == [0.25, 0.75, 1.25, 1.75]
    assert all(n.retention is None and n.group == "one-off" and not n.children for n in noise)
    assert not agent(TokenSource.random(500), sessions=1, noise=0, retention_s=0).roots[0].retention


def test_the_runner_waits_out_pauses_and_can_leave_hints_out():
    import asyncio

    from radixserve.benchmark.backends import StreamEvent
    from radixserve.benchmark.runner import run
    from radixserve.benchmark.workloads import agent
    from radixserve.results import Usage

    class Recorder:
        name = "recorder"

        def __init__(self) -> None:
            self.sent: list[tuple[float, tuple | None]] = []

        async def stream(self, input_ids, max_tokens, logprob_start_len=None,
                         structured=None, priority=0, retention=None):  # fmt: skip
            self.sent.append((time.perf_counter(), retention))
            yield StreamEvent("x", [3] * max_tokens, Usage(len(input_ids), max_tokens, 0),
                              finish_reason="length")  # fmt: skip

    w = agent(TokenSource.random(500, seed=2), sessions=1, turns=3, system_len=4,
              context_len=4, user_len_min=2, user_len_max=2, output_len=1, pause=0.2,
              noise=0)  # fmt: skip
    for hints in (True, False):
        backend = Recorder()
        result = asyncio.run(run(w, backend, progress=False, retention=hints))  # type: ignore[arg-type]
        assert [r.group for r in result.records] == ["turn 1", "turn 2", "turn 3"]
        times = [t for t, _ in backend.sent]
        assert all(b - a >= 0.2 for a, b in zip(times, times[1:]))  # the tool's pause
        assert {r for _, r in backend.sent} == ({(50, 600.0)} if hints else {None})
