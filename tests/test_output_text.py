"""OutputText keeps its text as chunks and a short tail: it must stream exactly what the plain
algorithm (the whole text as one string, searched and sliced on every token) streams."""

from __future__ import annotations

import random

from worker.detokenizer import OutputText


class PlainText:
    """The reference: the whole text as one string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop, self.text, self.emitted = stop, "", 0
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def take(self, piece: str) -> tuple[str, bool]:
        before = len(self.text)
        self.text += piece
        if self.stop:
            hits = [i for i in (self.text.find(s, max(0, before - self.holdback)) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self.flush(), True
        safe_end = max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted:safe_end], safe_end
        return delta, False

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta


def test_streams_what_the_plain_algorithm_streams():
    rng = random.Random(0)
    alphabet = "ab c\u00e9\u4e2d\U0001f600"
    for trial in range(400):
        stop = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3)))
        fast, plain = OutputText(None, stop), PlainText(stop)
        for _ in range(rng.randint(0, 60)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 0, 1, 1, 2, 5])))
            got, want = fast.take(piece), plain.take(piece)
            assert got == want, (trial, stop, piece)
            assert fast.text == plain.text and fast.emitted == plain.emitted and len(fast) == len(plain.text)
            if want[1]:
                break
        assert fast.flush() == plain.flush()
        assert fast.text == plain.text


def test_a_long_generation_keeps_a_short_tail():
    text = OutputText(None, ("STOP!",))
    streamed = "".join(text.take("word ")[0] for _ in range(10_000))
    assert len(text._tail) <= len("word ") + text.holdback
    assert streamed + text.flush() == "word " * 10_000 == text.text
