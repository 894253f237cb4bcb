"""Output text of one request: incremental decoding and stop strings.

Stop strings are matched on the decoded text; the matched string and everything after it are
dropped (as vLLM does). While stop strings are set, the last ``max(len(stop)) - 1`` characters
are held back from the stream until they can no longer start a match, so the concatenated
stream always equals the final text.
"""

from __future__ import annotations

from worker.tokenizer import IncrementalDecoder, add_each


class OutputText:
    def __init__(self, decoder, stop: tuple[str, ...]) -> None:
        self.decoder = decoder
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (text delta safe to stream, whether a stop string matched)."""
        return self.take(self.decoder.add(token_id))

    def take(self, piece: str) -> tuple[str, bool]:
        """Add the text ``piece`` that a token completed (see :func:`append_each`); as :meth:`append`."""
        before = len(self.text)
        self.text += piece
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


def append_each(texts: list[OutputText], token_ids: list[int]) -> list[tuple[str, bool]]:
    """``[t.append(tok) for t, tok in zip(texts, token_ids)]``, detokenizing all the tokens in one
    batch (:func:`worker.tokenizer.add_each`) where the texts have a tokenizer's decoder."""
    batched = [i for i, t in enumerate(texts) if isinstance(t.decoder, IncrementalDecoder)]
    pieces = [""] * len(texts)
    if batched:
        for i, piece in zip(batched, add_each([texts[i].decoder for i in batched], [token_ids[i] for i in batched])):
            pieces[i] = piece
    done = set(batched)
    return [t.take(pieces[i]) if i in done else t.append(tok) for i, (t, tok) in enumerate(zip(texts, token_ids))]
