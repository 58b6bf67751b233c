"""Stop strings over a stream of text deltas.

A stop string may straddle deltas, so the last ``max(len(stop)) - 1``
characters are held back until it is clear they do not start one. When a stop
string appears, the text before it is released and the request must stop (the
stop string itself is not returned, as in OpenAI's API).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.buffer = ""  # text not yet released
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return what can be released now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self.stop:
            return delta
        self.buffer += delta
        first = -1
        for s in self.stop:
            i = self.buffer.find(s)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self.stopped = True
            out, self.buffer = self.buffer[:first], ""
            return out
        cut = max(len(self.buffer) - self.hold, 0)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def flush(self) -> str:
        """At the end of the request: release what was held back."""
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
