"""Prompt programs and tokenize on a launched server, against the in-process Engine."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixserve.client import AsyncClient, ServerError
from radixserve.program import BranchError

GREEDY = dict(temperature=0.0, ignore_eos=True)
CHOICES = [" yes", " no", " it depends"]


def test_tokenize_equals_the_engines(client, engine):
    text = "The quick brown fox"
    assert client.tokenize(text) == engine.inputs.tokenize(text)
    assert client.tokenize(text, add_special_tokens=False) == engine.inputs.tokenize(
        text, add_special_tokens=False
    )
    assert client.tokenize("", add_special_tokens=False) == []
    chat = [{"role": "user", "content": "Hi"}]
    for opening in (True, False):
        got = client.tokenize(messages=chat, add_generation_prompt=opening)
        assert got == engine.inputs.tokenize(messages=chat, add_generation_prompt=opening)
    with pytest.raises(ServerError, match="tokens"):
        client.tokenize("word " * 2000)  # over the context, as a prompt would be
    with pytest.raises(ValueError, match="exactly one"):
        client.tokenize()


def program(s, i: int, page: int):
    """gen, select, fork and a batched gen; returns every state's token ids."""
    s += f" Fact number {i}:"
    s.gen("fact", max_tokens=6, **GREEDY)
    s += " Is it true?"
    s.select("verdict", CHOICES)
    branches = s.fork(2)
    for j, b in enumerate(branches):
        b += f" Reason {j}:"
    branches.gen("reason", max_tokens=5, **GREEDY)
    for b in branches:  # the fork computed the context once
        assert b.results["reason"].usage.cached_tokens >= len(s.token_ids) // page * page
    return [s.token_ids] + [b.token_ids for b in branches]


async def program_async(s, i: int):
    s += f" Fact number {i}:"
    await s.gen("fact", max_tokens=6, **GREEDY)
    s += " Is it true?"
    await s.select("verdict", CHOICES)
    branches = await s.fork(2)
    for j, b in enumerate(branches):
        b += f" Reason {j}:"
    await branches.gen("reason", max_tokens=5, **GREEDY)
    return [s.token_ids] + [b.token_ids for b in branches]


def test_programs_equal_the_engines_concurrently(server, client, engine):
    want = [program(engine.program("Facts."), i, engine.config.page_size) for i in range(4)]
    page = client.health()["page_size"]
    # Several programs at once on one client, each on its own thread.
    with ThreadPoolExecutor(4) as pool:
        got = list(
            pool.map(lambda i: program(client.program("Facts.", timeout=60), i, page), range(4))
        )
    assert got == want

    async def run_async():
        async with AsyncClient(server.endpoint, timeout=60) as ac:
            return await asyncio.gather(*(program_async(ac.program("Facts."), i) for i in range(2)))

    assert asyncio.run(run_async()) == want[:2]

    # A branch the server refuses fails with its index; the program's requests end.
    with client.program("Facts.") as s:
        branches = s.fork(3)
        branches[1] += [5] * 600  # beyond the model's context
        with pytest.raises(BranchError) as info:
            branches.gen("x", max_tokens=2)
    assert (info.value.branch, info.value.name) == (1, "x")
    assert isinstance(info.value.error, ServerError)

    # Per-branch functions on threads: the failing one is named; the others' requests
    # are aborted (the fixture then checks that nothing is left in flight).
    def work(b):
        if b is branches[1]:
            b.gen("y", max_tokens=2)  # still beyond the context
        return b.gen("long", max_tokens=200, **GREEDY)

    with pytest.raises(BranchError) as info:
        branches.run(work)
    assert (info.value.branch, info.value.name) == (1, "y")


def test_a_timed_out_program_leaves_other_programs_alone(client, engine):
    """Requests that time out are aborted; a program running beside them is untouched
    (and the fixture's idle check finds no page or request left)."""
    import threading

    from radixserve import SamplingParams
    from radixserve.client import RequestTimeout

    [want] = engine.generate("Facts. Then", SamplingParams(max_tokens=12, **GREEDY))
    got = {}

    def steady():
        with client.program("Facts. Then", timeout=60) as s:
            s.gen("x", max_tokens=12, **GREEDY)
            got["text"] = s["x"]

    thread = threading.Thread(target=steady)
    thread.start()
    hurried = client.program("Facts.", timeout=0.005)
    with pytest.raises((RequestTimeout, BranchError)) as info:
        hurried.fork(3).gen("slow", max_tokens=200, **GREEDY)
    thread.join()
    error = info.value.error if isinstance(info.value, BranchError) else info.value
    assert isinstance(error, RequestTimeout)
    assert got["text"] == want.text
