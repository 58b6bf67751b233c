"""The structured-output grammars the scheduler has the worker compile: which are in
use, which the next step submits or lets go, and which have compiled.

A grammar is named by its key (``StructuredOutput.key``) and shared by every sample
that uses it: the first sample asks for it (submitted with the next step), the last
one to finish lets it go (named in the next step's ``drop_grammars``). One asked for
and let go between two steps is never sent; one let go and asked for again before
the step is kept, since the worker still holds it. The worker reports a grammar
compiled (``grammars_ready``) or failed (``grammar_failures``); a waiting request
is admitted only once its grammar is ready.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.protocol import GrammarSpec, StepResult
from radixserve.sampling_params import StructuredOutput


@dataclass(eq=False)
class _Grammar:
    """How many unfinished samples use a grammar, and whether the worker reported it
    compiled."""

    refs: int = 0
    ready: bool = False


class Grammars:
    """The scheduler's grammars (module docstring)."""

    def __init__(self) -> None:
        self._in_use: dict[str, _Grammar] = {}
        self._submit: dict[str, GrammarSpec] = {}
        self._drop: dict[str, _Grammar] = {}

    def use(self, so: StructuredOutput, samples: int) -> None:
        """``samples`` new samples use ``so``'s grammar."""
        grammar = self._in_use.get(so.key)
        if grammar is None:
            # Let go since the last step: the worker still holds it.
            grammar = self._drop.pop(so.key, None)
            if grammar is None:
                grammar = _Grammar()
                self._submit[so.key] = GrammarSpec(so.key, so.kind, so.spec)
            self._in_use[so.key] = grammar
        grammar.refs += samples

    def release(self, so: StructuredOutput) -> None:
        """One sample using ``so``'s grammar is done (nothing if the grammar failed)."""
        grammar = self._in_use.get(so.key)
        if grammar is None:
            return
        grammar.refs -= 1
        if grammar.refs == 0:
            del self._in_use[so.key]
            if self._submit.pop(so.key, None) is None:  # else never sent
                self._drop[so.key] = grammar

    def ready(self, key: str) -> bool:
        return self._in_use[key].ready

    @property
    def news_pending(self) -> bool:
        """Grammars to submit or let go that no step has carried yet."""
        return bool(self._submit or self._drop)

    @property
    def compiling(self) -> bool:
        """A grammar in use has not compiled yet."""
        return any(not g.ready for g in self._in_use.values())

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def take_news(self) -> tuple[list[GrammarSpec], list[str]]:
        """What the next step submits and lets go; taken once."""
        submit, self._submit = list(self._submit.values()), {}
        drop, self._drop = list(self._drop), {}
        return submit, drop

    def take_result(self, result: StepResult) -> list[tuple[str, str]]:
        """Mark the grammars compiled since the last step ready; return (key, message)
        of each in use that failed (forgotten here: its requests fail)."""
        for key in result.grammars_ready:
            grammar = self._in_use.get(key)
            if grammar is not None:
                grammar.ready = True
        failed = []
        for failure in result.grammar_failures:
            if self._in_use.pop(failure.key, None) is not None:
                failed.append((failure.key, failure.message))
        return failed
