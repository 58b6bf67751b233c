"""Prompt programs: a context held as exact token ids, extended by text, generation
and choice, and forked into branches that share its KV through the prefix cache.

    s = engine.program("Q: What is 2 + 2?\\nA:")      # or client.program(...)
    s.gen("answer", max_tokens=16, temperature=0, stop=["\\n"])
    s += "\\nIs that right? "
    s.select("verdict", ["yes", "no"])
    print(s["answer"], s["verdict"])

    branches = s.fork(3)                              # the context is computed once
    branches.gen("idea", max_tokens=32, temperature=0.8)
    print(branches.values("idea"))

The context never goes through text again: each request sends it as
``input_ids``, so what the model saw is exactly what the next request extends
(no re-tokenization drift, and every request's prefix is the previous one's,
which the radix cache serves). The rules, in docs/programs.md:

- ``s += "text"`` appends the text's tokens, tokenized on its own, without
  special tokens; ``s += [ids]`` appends token ids. The program's first prompt
  gets the tokenizer's special tokens (BOS), as ``generate(prompt)`` would.
- ``s.gen(name, ...)`` appends exactly the tokens the model generated (with a stop
  string, the tokens that produced it too) and stores the text in ``s[name]``
  (without the stop string), the ``Result`` in ``s.results[name]``.
- ``s.select(name, choices)`` scores each choice by the mean logprob of its tokens
  after the context (token-length normalization), appends the winner's tokens
  (the first of equal scores) and stores it; ``s.results[name]`` is a
  ``Selection``.
- ``s.fork(n)`` first makes the context resident (a ``max_tokens=0`` request,
  unless an earlier request of this program already computed all of it), then
  returns ``Branches`` of n copies. ``branches.gen`` / ``branches.select`` run one
  operation on every branch at once (one batch in the Engine, concurrent requests
  on a server); ``branches.run(fn)`` calls ``fn(branch)`` for each (on threads with
  a ``Client``, one after another with the Engine, as tasks with an
  ``AsyncClient``). A branch that fails raises ``BranchError`` (its index, and the
  variable it was computing); with a client the other branches' requests are
  aborted.
- Chat: ``program(messages=[...])`` starts from the template's rendering of the
  messages; ``s.system/user/assistant(text)`` append one message: the tokens by
  which the rendering of the conversation with it extends the rendering without
  it; ``s.assistant_gen(name, ...)`` appends the template's generation prompt,
  generates, then replaces the generated tokens by the template's rendering of
  the assistant message. After each message the chat part of the context is
  exactly what ``tokenize(messages=...)`` gives for the conversation so far.

``AsyncProgramState`` (``AsyncClient.program``) has the same operations as
coroutines; there ``s += "text"`` is tokenized at the next awaited operation (or
``await s.flush()``).
"""

from radixserve.program.backends import AsyncClientBackend, ClientBackend, EngineBackend
from radixserve.program.plans import MAX_THREADS, BranchError, ProgramError, Selection
from radixserve.program.state import AsyncBranches, AsyncProgramState, Branches, ProgramState

__all__ = [
    "MAX_THREADS",
    "AsyncBranches",
    "AsyncClientBackend",
    "AsyncProgramState",
    "BranchError",
    "Branches",
    "ClientBackend",
    "EngineBackend",
    "ProgramError",
    "ProgramState",
    "Selection",
]
