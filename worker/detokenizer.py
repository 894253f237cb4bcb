"""Output text of requests: incremental decoding (one request's, or a step's for every request in
one batch) and stop strings.

Stop strings are matched on the decoded text; the matched string and everything after it are
dropped (as vLLM does). While stop strings are set, the last ``max(len(stop)) - 1`` characters
are held back from the stream until they can no longer start a match, so the concatenated
stream always equals the final text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Protocol

_REPLACEMENT_CHAR = "\ufffd"


class TextDecoder(Protocol):
    """What a streaming decoder needs of its tokenizer (:class:`worker.tokenizer.Tokenizer` is one)."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def decode_batch(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]: ...


class OutputText:
    """A request's output text, its stop strings, and how much of it has been streamed.

    Appending costs the piece, not the text so far: the text lives as chunks plus a short tail
    (the characters a stop string could still start in, and those not yet streamed), so a long
    generation does not copy its whole text on every token.
    """

    def __init__(self, decoder, stop: tuple[str, ...]) -> None:
        self.decoder = decoder
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0  #: characters streamed so far
        self.matched: str | None = None  #: the stop string that ended the text (the earliest found)
        self._done: list[str] = []  # text before ``_base``
        self._base = 0
        self._tail = ""  # text[_base:]; _base <= min(emitted, len(text) - holdback)

    @property
    def text(self) -> str:
        """The text so far (a stop string and what followed it cut off)."""
        if self._done:
            self._done = ["".join(self._done)]
        return (self._done[0] if self._done else "") + self._tail

    def __len__(self) -> int:
        return self._base + len(self._tail)

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (text delta safe to stream, whether a stop string matched)."""
        return self.take(self.decoder.add(token_id))

    def take(self, piece: str) -> tuple[str, bool]:
        """Add the text ``piece`` that a token completed (see :func:`append_each`); as :meth:`append`."""
        if not self.stop:  # nothing held back: the piece streams as it is
            if piece:
                self._done.append(piece)
                self._base += len(piece)
                self.emitted = self._base
            return piece, False
        base, before = self._base, self._base + len(self._tail)
        tail = self._tail = self._tail + piece
        # A match may start up to holdback characters before the piece (never before _base).
        search_from = max(0, before - self.holdback) - base
        hits = [(i, s) for i, s in ((tail.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self._tail = tail[:at]
            return self.flush(), True
        end = base + len(tail)
        safe_end = max(self.emitted, end - self.holdback)
        delta = tail[self.emitted - base: safe_end - base]
        self.emitted = safe_end
        keep_from = min(self.emitted, end - self.holdback) - base
        if keep_from > 0:
            self._done.append(tail[:keep_from])
            self._tail = tail[keep_from:]
            self._base = base + keep_from
        return delta, False

    def flush(self) -> str:
        """Everything not yet streamed (call once the request has finished)."""
        end = self._base + len(self._tail)
        delta = self._tail[max(0, self.emitted - self._base):]
        self.emitted = end
        return delta


class _StreamDecoder(ABC):
    """What both streaming decoders share: the tokenizer, ``skip_special_tokens``, the text emitted."""

    _tok: TextDecoder
    _skip: bool
    _chunks: list[str]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def tokenizer(self) -> TextDecoder:
        return self._tok

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip

    @abstractmethod
    def add(self, token_id: int) -> str:
        """Feed one id; return the text that became final (possibly ``""``)."""

    def extend(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; return the concatenated new text."""
        return "".join(self.add(t) for t in token_ids)


class IncrementalDecoder(_StreamDecoder):
    """Streaming detokenizer: feed generated ids one at a time, get the new text each time.

    Text is emitted only once it is stable: while the decoded tail ends with U+FFFD (an
    incomplete UTF-8 sequence split across tokens) it is held back.  The concatenation of all
    :meth:`add` results plus :meth:`flush` equals ``tokenizer.decode(generated_ids)`` for
    byte-level tokenizers.  ``prefix_ids`` (e.g. the prompt's last tokens) give context for
    tokenizers whose decoding depends on the preceding token (SentencePiece leading spaces);
    they are never emitted.
    """

    PREFIX_CONTEXT = 6

    def __init__(self, tokenizer: TextDecoder, skip_special_tokens: bool = True,
                 prefix_ids: Sequence[int] = ()) -> None:
        """Start a stream over ``tokenizer``."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prefix_ids[-self.PREFIX_CONTEXT :]] if prefix_ids else []
        self._n_prefix = len(self._ids)
        # Invariant: _ids[_prefix_offset:_read_offset] decodes to text already emitted (or context).
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Generated ids fed so far (excluding ``prefix_ids``)."""
        return self._ids[self._n_prefix :]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _windows(self) -> tuple[list[int], list[int]]:
        """The ids whose texts :meth:`accept` compares: the emitted context, and it with the new ids."""
        return self._ids[self._prefix_offset : self._read_offset], self._ids[self._prefix_offset :]

    def accept(self, prefix_text: str, new_text: str, final: bool = False) -> str:
        """After :meth:`push`: the text that became final, given the decoded windows."""
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta

    def _delta(self, final: bool) -> str:
        prefix, new = self._windows()
        return self.accept(self._decode(prefix), self._decode(new), final)

    def add(self, token_id: int) -> str:
        """Feed one id; return the text that became final (possibly ``""``)."""
        self._ids.append(int(token_id))
        return self._delta(final=False)

    def push(self, token_id: int) -> tuple[list[int], list[int]]:
        """Feed one id without decoding: the two id windows to decode (with this decoder's
        ``skip_special_tokens``) and hand to :meth:`accept`; :func:`add_each` does it for many."""
        self._ids.append(int(token_id))
        return self._windows()

    def flush(self) -> str:
        """End of stream: return any held-back text (an incomplete character decodes as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._delta(final=True)


class ByteLevelDecoder(_StreamDecoder):
    """:class:`IncrementalDecoder` for a byte-level tokenizer, from its bytes table
    (:func:`worker.byte_level.byte_level_tables`) instead of calls into the tokenizer: each token
    appends its bytes to what is not yet emitted, and the UTF-8 text of those bytes is emitted once
    it does not end with U+FFFD. It emits exactly what :class:`IncrementalDecoder` emits, token by
    token, when the prompt's last tokens end on a whole character
    (:meth:`worker.tokenizer.Tokenizer.incremental_decoder` picks it only then).
    """

    def __init__(self, tokenizer: TextDecoder, table: Sequence[bytes], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._table = table
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._pending = b""  # bytes of tokens whose text is not emitted yet
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Generated ids fed so far."""
        return list(self._ids)

    def add(self, token_id: int) -> str:
        """Feed one id; return the text that became final (possibly ``""``)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        piece = self._table[token_id] if 0 <= token_id < len(self._table) else b""
        if not piece:
            return ""
        pending = self._pending + piece
        text = pending.decode("utf-8", "replace")
        if text.endswith(_REPLACEMENT_CHAR):
            self._pending = pending
            return ""
        self._pending = b""
        self._chunks.append(text)
        return text

    def flush(self) -> str:
        """End of stream: return any held-back text (an incomplete character decodes as U+FFFD)."""
        if not self._pending:
            return ""
        text, self._pending = self._pending.decode("utf-8", "replace"), b""
        self._chunks.append(text)
        return text


def add_each(decoders: Sequence[IncrementalDecoder | ByteLevelDecoder], token_ids: Sequence[int]) -> list[str]:
    """``[d.add(t) for d, t in zip(decoders, token_ids)]`` with one backend call per
    ``skip_special_tokens`` value for the :class:`IncrementalDecoder` ones (all over one tokenizer):
    a step's tokens for every request together, decoded outside the GIL. A
    :class:`ByteLevelDecoder` needs no backend call: it decodes on its own."""
    # Exact types, not isinstance: both derive from an ABC, whose isinstance is the slow path.
    if all(type(d) is ByteLevelDecoder for d in decoders):
        return [d.add(t) for d, t in zip(decoders, token_ids)]
    out = [""] * len(decoders)
    batched: list[int] = []
    for i, (d, t) in enumerate(zip(decoders, token_ids)):
        if isinstance(d, IncrementalDecoder):
            batched.append(i)
        else:
            out[i] = d.add(t)
    if not batched:
        return out
    windows = {i: decoders[i].push(token_ids[i]) for i in batched}
    for skip in {decoders[i].skip_special_tokens for i in batched}:
        which = [i for i in batched if decoders[i].skip_special_tokens == skip]
        flat = decoders[which[0]].tokenizer.decode_batch(  # one tokenizer for all
            [ids for i in which for ids in windows[i]], skip_special_tokens=skip)
        for k, i in enumerate(which):
            out[i] = decoders[i].accept(flat[2 * k], flat[2 * k + 1])
    return out


_STREAM_DECODERS = frozenset({IncrementalDecoder, ByteLevelDecoder})


def append_each(texts: list[OutputText], token_ids: list[int]) -> list[tuple[str, bool]]:
    """``[t.append(tok) for t, tok in zip(texts, token_ids)]``, detokenizing all the tokens in one
    batch (:func:`add_each`) when the texts have a tokenizer's decoders (an engine's all have, or
    none); :class:`ByteLevelDecoder` texts decode on their own (a table look-up each)."""
    decoders = [t.decoder for t in texts]
    if not all(type(d) in _STREAM_DECODERS for d in decoders):  # exact types: isinstance of an ABC is slow
        return [t.append(tok) for t, tok in zip(texts, token_ids)]
    return [t.take(piece) for t, piece in zip(texts, add_each(decoders, token_ids))]
