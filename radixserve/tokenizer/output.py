"""One sample's text as its tokens arrive: detokenize, apply stop strings, collect."""

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

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = StopStringMatcher(stop)
        self.token_ids: list[int] = []
        self.text = ""

    @property
    def stop_hit(self) -> bool:
        return self.stop.stopped

    def add(self, token_ids: list[int], finished: bool) -> str:
        if self.stop.stopped:
            return ""
        self.token_ids.extend(token_ids)
        delta = self.stop.feed(self.detok.add(token_ids))
        if finished and not self.stop.stopped:
            delta += self.stop.feed(self.detok.flush())
            delta += self.stop.flush()
        self.text += delta
        return delta
