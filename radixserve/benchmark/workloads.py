"""The workloads: which token sequences are sent, and which wait for which.

A workload is a list of root requests in send order; a request may have
children that are sent when it finishes, each with the prompt
``parent prompt + parent output + its own new tokens`` (a conversation's next
turn, a branch of a tree). Prompts are token ids, so lengths are exact and the
offline-optimal hit rate can be computed over exactly what was sent.

A scored request (``Node.score``, the few-shot workload's scoring mode) asks
for the logprobs of its prompt's last tokens instead of a completion, as an
evaluation harness scores a multiple-choice question: one request per choice.

A structured request (``Node.structured``, the json-extract workload) constrains
its completion to a JSON schema; it ends when the object is complete.

Tokens come from a ``TokenSource``: random ids from the vocabulary (special
tokens excluded) or runs of real English (the standard library's
``pydoc_data.topics``) tokenized by the model's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.sampling_params import StructuredOutput

WORKLOADS = ("shared-prefix", "multi-turn", "few-shot", "tree", "json-extract", "copy", "agent")


@dataclass(frozen=True)
class Score:
    """What a scored request is: choice ``choice`` of question ``question``, whose
    tokens start at prompt position ``start`` (the context and question before it)."""

    question: str
    choice: int
    start: int


@dataclass
class Node:
    """One request. ``tokens``: the whole prompt for a root; for a child, what follows
    its parent's prompt and output. ``score``: set when the request scores its
    prompt's tail (prompt logprobs from ``score.start`` on). ``structured``: set
    when its completion must follow a JSON schema (``max_tokens`` is then a bound:
    it stops when the object is complete). ``priority`` and ``retention`` (its
    ``cache_retention``): what ``mix_priorities`` (or the agent workload) set, sent
    as they are. ``delay``: seconds between its parent's end (a root: its arrival)
    and its sending, a client's pause (an agent's tool call). ``group``: the table
    breaks TTFT and hit rate down by it when set (the agent workload's turns)."""

    key: str
    tokens: list[int]
    max_tokens: int
    children: list[Node] = field(default_factory=list)
    score: Score | None = None
    structured: StructuredOutput | None = None
    priority: int = 0
    retention: tuple[int, float] | None = None
    delay: float = 0.0
    group: str = ""

    def walk(self) -> Iterator[Node]:
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass
class Workload:
    name: str
    params: dict[str, Any]
    roots: list[Node]
    # Scoring workloads: question -> the index of its right choice.
    answers: dict[str, int] = field(default_factory=dict)

    @property
    def scored(self) -> bool:
        return any(n.score is not None for r in self.roots for n in r.walk())

    @property
    def structured(self) -> bool:
        return any(n.structured is not None for r in self.roots for n in r.walk())

    @property
    def num_requests(self) -> int:
        return sum(1 for r in self.roots for _ in r.walk())

    def max_prompt_len(self) -> int:
        """Longest prompt + output any request can need (for context checks)."""

        def longest(node: Node, before: int) -> int:
            here = before + len(node.tokens) + node.max_tokens
            return max([here] + [longest(c, here) for c in node.children])

        return max((longest(r, 0) for r in self.roots), default=0)


class TokenSource:
    """Draws token runs: uniformly random ids, or slices of a tokenized text.

    ``encode`` (set when the source comes from a tokenizer) turns a fixed
    instruction into ids; a workload that has one sends it only then."""

    def __init__(
        self,
        rng: np.random.Generator,
        vocab: np.ndarray | None = None,
        text: Sequence[int] = (),
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        if vocab is None and not text:
            raise ValueError("a token source needs a vocabulary or a text")
        self.rng, self.vocab, self.text = rng, vocab, np.asarray(text, dtype=np.int64)
        self.encode = encode
        # One user message rendered in the model's chat format with the generation
        # prompt after it (set by ``from_tokenizer`` when the tokenizer has a template).
        self.chat: Callable[[str], str] | None = None

    @classmethod
    def random(cls, vocab_size: int, seed: int = 0, exclude: Sequence[int] = ()) -> TokenSource:
        ids = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude, dtype=np.int64))
        return cls(np.random.default_rng(seed), vocab=ids)

    @classmethod
    def real_text(cls, text_ids: Sequence[int], seed: int = 0) -> TokenSource:
        return cls(np.random.default_rng(seed), text=text_ids)

    def take(self, n: int) -> list[int]:
        if self.vocab is not None:
            return [int(t) for t in self.rng.choice(self.vocab, n)]
        # A slice starting at a random place, wrapping around the text if it must.
        start = int(self.rng.integers(len(self.text)))
        idx = (start + np.arange(n)) % len(self.text)
        return [int(t) for t in self.text[idx]]

    def between(self, lo: int, hi: int) -> list[int]:
        return self.take(int(self.rng.integers(lo, hi + 1)))


def from_tokenizer(tokenizer: Any, kind: str, seed: int = 0) -> TokenSource:
    """A TokenSource for a transformers tokenizer: ``kind`` "random" or "text"."""
    if kind == "random":
        src = TokenSource.random(len(tokenizer), seed, exclude=tokenizer.all_special_ids)
    elif kind == "text":
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))[:400_000]  # ample, and quick
        src = TokenSource.real_text(tokenizer.encode(text, add_special_tokens=False), seed)
    else:
        raise ValueError(f"unknown prompt kind {kind!r}: random or text")
    src.encode = lambda s: tokenizer.encode(s, add_special_tokens=False)
    if getattr(tokenizer, "chat_template", None):
        src.chat = lambda s: tokenizer.apply_chat_template(
            [{"role": "user", "content": s}], add_generation_prompt=True, tokenize=False
        )
    return src


def shared_prefix(
    src: TokenSource,
    groups: int = 64,
    prompts: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    order: str = "shuffled",
) -> Workload:
    """G groups of P prompts; each = the group's system prompt + its own question."""
    roots = []
    for g in range(groups):
        system = src.take(system_len)
        for p in range(prompts):
            roots.append(Node(f"g{g}-p{p}", system + src.take(question_len), output_len))
    if order == "shuffled":
        src.rng.shuffle(roots)  # type: ignore[arg-type]
    elif order != "ordered":
        raise ValueError(f"unknown order {order!r}: shuffled or ordered")
    params = dict(
        groups=groups,
        prompts=prompts,
        system_len=system_len,
        question_len=question_len,
        output_len=output_len,
        order=order,
    )
    return Workload("shared-prefix", params, roots)


def multi_turn(
    src: TokenSource,
    conversations: int = 16,
    turns: int = 4,
    system_len: int = 0,
    user_len_min: int = 256,
    user_len_max: int = 512,
    answer: str = "short",
    output_len: int | None = None,
) -> Workload:
    """Conversations of T turns; turn t's prompt = all of turn t-1 (prompt and answer)
    + a new user message. Turns are sequential, conversations concurrent."""
    out = output_len if output_len is not None else {"short": 32, "long": 256}[answer]
    roots = []
    for c in range(conversations):
        head = Node(f"c{c}-t0", src.take(system_len) + src.between(user_len_min, user_len_max), out)
        node = head
        for t in range(1, turns):
            child = Node(f"c{c}-t{t}", src.between(user_len_min, user_len_max), out)
            node.children.append(child)
            node = child
        roots.append(head)
    params = dict(
        conversations=conversations,
        turns=turns,
        system_len=system_len,
        user_len_min=user_len_min,
        user_len_max=user_len_max,
        answer=answer,
        output_len=out,
    )
    return Workload("multi-turn", params, roots)


def few_shot(
    src: TokenSource,
    subjects: int = 8,
    questions: int = 32,
    shots: int = 5,
    example_len: int = 128,
    question_len: int = 64,
    output_len: int = 1,
) -> Workload:
    """k-shot prompts (MMLU-like): per subject, k shared examples; each question differs;
    a one-token answer. Questions of all subjects are interleaved."""
    per_subject = []
    for s in range(subjects):
        examples = [t for _ in range(shots) for t in src.take(example_len)]
        per_subject.append(
            [
                Node(f"s{s}-q{q}", examples + src.take(question_len), output_len)
                for q in range(questions)
            ]
        )
    roots = [per_subject[s][q] for q in range(questions) for s in range(subjects)]
    params = dict(
        subjects=subjects,
        questions=questions,
        shots=shots,
        example_len=example_len,
        question_len=question_len,
        output_len=output_len,
    )
    return Workload("few-shot", params, roots)


def few_shot_score(
    src: TokenSource,
    subjects: int = 8,
    questions: int = 32,
    shots: int = 5,
    example_len: int = 128,
    question_len: int = 64,
    choices: int = 4,
    choice_len: int = 4,
) -> Workload:
    """Multiple-choice scoring (as lm-eval scores MMLU-like tasks): per subject, k
    shared examples; per question, ``choices`` requests, each = examples + question
    + one choice (1 to ``choice_len`` tokens), asking for the logprobs of the
    choice's tokens and one output token. Questions of all subjects are
    interleaved; a question's choices are sent one after the other. Each question
    gets a random right answer (for the accuracy, a sanity check only)."""
    if choices < 1 or choice_len < 1:
        raise ValueError(f"choices and choice_len must be >= 1, got {choices}, {choice_len}")
    per_subject = []
    answers: dict[str, int] = {}
    for s in range(subjects):
        examples = [t for _ in range(shots) for t in src.take(example_len)]
        subject = []
        for q in range(questions):
            head = examples + src.take(question_len)
            key = f"s{s}-q{q}"
            answers[key] = int(src.rng.integers(choices))
            drawn: list[list[int]] = []
            for _ in range(100 * choices):  # distinct choices, as a real question has
                if len(drawn) == choices:
                    break
                choice = src.between(1, choice_len)
                if choice not in drawn:
                    drawn.append(choice)
            if len(drawn) < choices:
                raise ValueError(f"could not draw {choices} distinct choices: raise --choice-len")
            nodes = [
                Node(f"{key}-c{c}", head + tokens, 1, [], Score(key, c, len(head)))
                for c, tokens in enumerate(drawn)
            ]
            subject.append(nodes)
        per_subject.append(subject)
    roots = [n for q in range(questions) for s in range(subjects) for n in per_subject[s][q]]
    params = dict(
        subjects=subjects,
        questions=questions,
        shots=shots,
        example_len=example_len,
        question_len=question_len,
        choices=choices,
        choice_len=choice_len,
    )
    return Workload("few-shot-score", params, roots, answers)


def tree(
    src: TokenSource,
    trees: int = 4,
    depth: int = 3,
    branches: int = 2,
    root_len: int = 1024,
    branch_len: int = 32,
    output_len: int = 64,
) -> Workload:
    """Branching generation: each answer forks into B continuations (the answer +
    a different short instruction), for D levels below the root."""

    def grow(key: str, tokens: list[int], level: int) -> Node:
        node = Node(key, tokens, output_len)
        if level < depth:
            node.children = [
                grow(f"{key}.{b}", src.take(branch_len), level + 1) for b in range(branches)
            ]
        return node

    roots = [grow(f"t{i}", src.take(root_len), 0) for i in range(trees)]
    params = dict(
        trees=trees,
        depth=depth,
        branches=branches,
        root_len=root_len,
        branch_len=branch_len,
        output_len=output_len,
    )
    return Workload("tree", params, roots)


def _record(*fields: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """A strict object schema: every field required, nothing else allowed."""
    return {
        "type": "object",
        "properties": dict(fields),
        "required": [name for name, _ in fields],
        "additionalProperties": False,
    }


def _text(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


_BOOL = {"type": "boolean"}

# What json-extract asks for: (what the instruction names, its schema). Long constant
# keys, as in SGLang's JSON decoding benchmark, and one field of each kind: short
# strings, bounded integers, an enum, a boolean. The schemas' key order is kept.
RECORDS: list[tuple[str, dict[str, Any]]] = [
    (
        "employee record",
        _record(
            ("employee_full_name", _text(24)),
            ("department_name", {"enum": ["Research and Development", "Customer Support",
                                          "Finance and Accounting", "Human Resources"]}),
            ("years_of_experience", _int(0, 50)),
            ("is_remote_employee", _BOOL),
            ("office_location_city", _text(20)),
            ("performance_review_score", _int(1, 5)),
        ),
    ),
    (
        "product listing",
        _record(
            ("product_display_name", _text(24)),
            ("product_category_name", {"enum": ["Home and Kitchen", "Consumer Electronics",
                                                "Sports and Outdoors", "Books and Media"]}),
            ("unit_price_in_dollars", _int(0, 10000)),
            ("is_currently_in_stock", _BOOL),
            ("manufacturer_company_name", _text(20)),
            ("warranty_period_in_months", _int(0, 60)),
        ),
    ),
    (
        "event announcement",
        _record(
            ("event_title_description", _text(32)),
            ("event_type_category", {"enum": ["conference", "workshop", "meetup", "webinar"]}),
            ("expected_number_of_attendees", _int(0, 100000)),
            ("is_free_admission", _BOOL),
            ("host_city_name", _text(20)),
            ("event_duration_in_days", _int(1, 14)),
        ),
    ),
    (
        "publication",
        _record(
            ("paper_title_text", _text(32)),
            ("first_author_full_name", _text(24)),
            ("research_field_name", {"enum": ["computer science", "molecular biology",
                                              "economics", "theoretical physics"]}),
            ("year_of_publication", _int(1900, 2030)),
            ("is_peer_reviewed", _BOOL),
            ("number_of_citations", _int(0, 100000)),
        ),
    ),
]  # fmt: skip


def json_extract(
    src: TokenSource,
    documents: int = 4,
    questions: int = 8,
    document_len: int = 800,
    question_len: int = 16,
    output_len: int = 256,
) -> Workload:
    """JSON decoding (SGLang's benchmark): per document, Q requests, each = the shared
    document + its own question tokens + an instruction naming one of ``RECORDS``'
    fields (when the source can encode text), whose completion must follow that
    record's schema, greedy, within ``output_len`` tokens. Question q asks for
    record q mod 4; questions of all documents are interleaved."""
    per_doc = []
    for d in range(documents):
        document = src.take(document_len)
        asks = []
        for q in range(questions):
            what, schema = RECORDS[q % len(RECORDS)]
            tokens = document + src.take(question_len)
            if src.encode is not None:
                fields = ", ".join(schema["properties"])
                instruction = (
                    f"\n\nExtract the {what} from the document above as a JSON object "
                    f"with the fields {fields}.\n"
                )
                tokens += src.encode(instruction)
            structured = StructuredOutput.json(json.dumps(schema, separators=(",", ":")))
            asks.append(Node(f"d{d}-q{q}", tokens, output_len, structured=structured))
        per_doc.append(asks)
    roots = [per_doc[d][q] for q in range(questions) for d in range(documents)]
    params = dict(
        documents=documents,
        questions=questions,
        document_len=document_len,
        question_len=question_len,
        output_len=output_len,
    )
    return Workload("json-extract", params, roots)


def copy(
    src: TokenSource,
    documents: int = 8,
    document_len: int = 256,
    output_len: int = 128,
    repeats: int = 1,
) -> Workload:
    """Outputs that copy their context: each prompt is a document (a run of the token
    source: real text with ``--prompt-kind text``) and an instruction to repeat it
    with one change, in the model's chat format when it has one; with ``repeats`` R
    each prompt is sent R times in a row (the same request recurring, as an agent
    loop replayed: the later ones find the first one's output in the cache).
    Speculative decoding's workload (docs/speculative.md)."""
    before, after = [], []
    if src.encode is not None:
        before, after = _chat_around(
            src,
            "Repeat the following text exactly, word for word, but write its first "
            "word in capital letters. Output only the text.\n\n",
        )
    roots = []
    for d in range(documents):
        prompt = before + src.take(document_len) + after
        for r in range(repeats):
            roots.append(Node(f"doc{d}-r{r}", list(prompt), output_len))
    params = dict(
        documents=documents, document_len=document_len, output_len=output_len, repeats=repeats
    )
    return Workload("copy", params, roots)


def _chat_around(src: TokenSource, instruction: str) -> tuple[list[int], list[int]]:
    """The token ids before and after a document inside one user message that starts
    with ``instruction``, in the chat format when the source has one (else plain)."""
    encode = src.encode
    assert encode is not None
    mark = "\u2063DOCUMENT\u2063"
    text = instruction + mark
    if src.chat is not None:
        text = src.chat(text)
    head, _, tail = text.partition(mark)
    return encode(head), encode(tail if src.chat is not None else "\n\nThe text, repeated:\n")


#: The agent workload's retention level (what the HTTP front sends: cache_steering.py).
AGENT_RETENTION_LEVEL = 50


def agent(
    src: TokenSource,
    sessions: int = 8,
    turns: int = 4,
    system_len: int = 256,
    context_len: int = 512,
    user_len_min: int = 32,
    user_len_max: int = 96,
    output_len: int = 16,
    pause: float = 1.0,
    noise: int = 32,
    noise_len: int = 512,
    retention_s: float = 600.0,
) -> Workload:
    """Agent sessions with tool pauses, under traffic that wants the same pages.

    Each session's first turn is a system prompt every session shares
    (``system_len``) and its own task (``context_len``); each later turn adds a tool's
    result (``user_len_min``..``user_len_max`` tokens) after a pause of ``pause``
    seconds (the tool running), so a session's context grows and is idle between
    turns. Every session request asks that its prompt be kept ``retention_s``
    seconds (``cache_retention``; ``radixserve bench agent`` also runs the workload
    without the hints). Meanwhile ``noise`` one-off requests of ``noise_len`` fresh
    tokens, spread evenly over the sessions' span, pass through the cache and are
    never reused. Size the server's pool below what the sessions hold, so sessions
    leave it during their pauses (docs/benchmark.md#agent)."""
    system = src.take(system_len)
    hint = (AGENT_RETENTION_LEVEL, retention_s) if retention_s > 0 else None
    roots = []
    for s in range(sessions):
        head = Node(f"s{s}-t0", system + src.take(context_len), output_len)
        head.retention, head.group = hint, "turn 1"
        node = head
        for t in range(1, turns):
            child = Node(f"s{s}-t{t}", src.between(user_len_min, user_len_max), output_len)
            child.retention, child.delay, child.group = hint, pause, f"turn {t + 1}"
            node.children.append(child)
            node = child
        roots.append(head)
    span = turns * pause
    for i in range(noise):
        one = Node(f"n{i}", src.take(noise_len), output_len)
        one.delay, one.group = span * (i + 0.5) / noise, "one-off"
        roots.append(one)
    params = dict(
        sessions=sessions,
        turns=turns,
        system_len=system_len,
        context_len=context_len,
        user_len_min=user_len_min,
        user_len_max=user_len_max,
        output_len=output_len,
        pause=pause,
        noise=noise,
        noise_len=noise_len,
        retention_s=retention_s,
    )
    return Workload("agent", params, roots)


BUILDERS = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "tree": tree,
    "json-extract": json_extract,
    "copy": copy,
    "agent": agent,
}
# The scoring mode of a workload (``radixserve bench few-shot --score``).
SCORE_BUILDERS = {"few-shot": few_shot_score}


def mix_priorities(
    workload: Workload,
    share: float,
    level: int = -1,
    retention: tuple[int, float] | None = None,
    seed: int = 0,
) -> None:
    """``--priority-mix``: give a seeded ``share`` of the roots, with every request
    below them (a conversation keeps one level), ``priority=level`` (lower goes first,
    so the default -1 is the urgent class) and, when given, ``cache_retention``;
    the rest keep priority 0. At least one root of each class when both are asked
    for (0 < share < 1) and there are two roots."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the priority share must be in [0, 1], got {share}")
    roots = workload.roots
    n = round(share * len(roots))
    if 0.0 < share < 1.0 and len(roots) >= 2:
        n = min(max(n, 1), len(roots) - 1)
    rng = np.random.default_rng(seed + 7)
    for i in sorted(rng.permutation(len(roots))[:n].tolist()):
        for node in roots[i].walk():
            node.priority, node.retention = level, retention
    workload.params["priority_mix"] = share
