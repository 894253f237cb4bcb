"""Output text of one request: incremental decoding and stop strings.

Stop strings are matched on the decoded text; the matched string and everything after it are
dropped (as vLLM does). While stop strings are set, the last ``max(len(stop)) - 1`` characters
are held back from the stream until they can no longer start a match, so the concatenated
stream always equals the final text.
"""

from __future__ import annotations


class OutputText:
    def __init__(self, decoder, stop: tuple[str, ...]) -> None:
        self.decoder = decoder
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (text delta safe to stream, whether a stop string matched)."""
        before = len(self.text)
        self.text += self.decoder.add(token_id)
        if self.stop:
            search_from = max(0, before - self.holdback)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self.flush(), True
        safe_end = max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:safe_end]
        self.emitted = safe_end
        return delta, False

    def flush(self) -> str:
        """Everything not yet streamed (call once the request has finished)."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
