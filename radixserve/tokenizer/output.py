"""One sample's text as its tokens arrive: detokenize, apply stop strings, collect;
and its logprobs, turned from the scheduler's entries into the public ones."""

from __future__ import annotations

from typing import Any

from radixserve.tokenizer.detokenizer import IncrementalDetokenizer
from radixserve.tokenizer.stop import StopStringMatcher


class OutputStream:
    """Turns token deltas into text deltas for one sample.

    ``add(token_ids, finished)`` returns the text that may be shown now. When
    a stop string appears, ``stop_hit`` turns True: the caller must stop the
    request at once (the scheduler aborts it with reason "stop") and the text
    ends before the stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop: tuple[str, ...],
        texts: TokenTexts | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = StopStringMatcher(stop)
        self.prompt_ids = prompt_ids
        self.texts = texts if texts is not None else TokenTexts(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""
        # Public entries ([id, text, logprob, top]): all of them, and those of the last add.
        self.logprobs: list[list] | None = None
        self.new_logprobs: list[list] | None = None
        self.new_token_ids: list[int] = []  # the tokens the last add took
        self.prompt_logprobs: list[list | None] | None = None

    @property
    def stop_hit(self) -> bool:
        return self.stop.stopped

    def add(
        self,
        token_ids: list[int],
        finished: bool,
        logprobs: list | None = None,
        prompt_logprobs: list | None = None,
    ) -> str:
        """Take new tokens (with their logprob entries, and the prompt's once);
        return the text that may be shown now.

        Several tokens at once (a verification's accepted drafts, jump-forward) are
        detokenized one by one, as if they had come in separate steps: the text is
        the same, and a stop string inside them ends the sample at the token that
        completes it (``new_token_ids``: the tokens taken; those after it are not)."""
        self.new_logprobs = None
        self.new_token_ids = []
        if self.stop.stopped:
            return ""
        if prompt_logprobs is not None:
            self.prompt_logprobs = self.texts.public(prompt_logprobs, self.prompt_ids)
        delta = ""
        for i, token in enumerate(token_ids):
            delta += self.stop.feed(self.detok.add([token]))
            if self.stop.stopped:
                token_ids = token_ids[: i + 1]
                break
        if logprobs is not None:
            logprobs = logprobs[: len(token_ids)]
            self.new_logprobs = self.texts.public(logprobs, token_ids)
            self.logprobs = (self.logprobs or []) + self.new_logprobs
        self.token_ids.extend(token_ids)
        self.new_token_ids = list(token_ids)
        if finished and not self.stop.stopped:
            delta += self.stop.feed(self.detok.flush())
            delta += self.stop.flush()
        self.text += delta
        return delta


class TokenTexts:
    """Each token's own text, as logprobs show it (special tokens included), cached."""

    def __init__(self, tokenizer: Any, max_cached: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) >= self.max_cached:
                self._cache.clear()
            self._cache[token_id] = t
        return t

    def public(self, entries: list, token_ids: list[int]) -> list:
        """The scheduler's ``[logprob, top ids, top logprobs]`` entries for
        ``token_ids`` as the public ``[token id, text, logprob, [[id, text,
        logprob], ...]]``; a null entry (a prompt position not scored) becomes
        ``[token id, text, null, []]``, so every prompt token's text is there."""
        out: list = []
        for tid, e in zip(token_ids, entries):
            if e is None:
                out.append([tid, self.text(tid), None, []])
                continue
            lp, ids, lps = e
            top = [[i, self.text(i), v] for i, v in zip(ids, lps)]
            out.append([tid, self.text(tid), lp, top])
        return out
