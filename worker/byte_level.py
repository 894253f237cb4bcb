"""The bytes each token stands for, for tokenizers whose decoder is HF's ``ByteLevel``.

A ``ByteLevel`` decoder (GPT-2, Llama-3, Qwen, our generated presets) maps every character of a
token string back to one byte (GPT-2's printable stand-ins for the 256 byte values) and decodes
the concatenated bytes of the whole sequence as UTF-8 with replacement. So the text of any id
sequence is ``b"".join(table[i] for i in ids).decode("utf-8", "replace")``, and a request's
stream can be detokenized without calling into the tokenizer at all
(:class:`worker.detokenizer.ByteLevelDecoder`).

:func:`byte_level_tables` builds the table from the token strings and then checks it against the
tokenizer itself (every id alone, and random sequences that split multi-byte characters across
tokens); any disagreement, or any other decoder, returns None and the caller keeps decoding
through the tokenizer.
"""

from __future__ import annotations

import json
import random
from typing import Any

_CHECK_SEQUENCES = 256
_CHECK_LENGTH = 12


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: the character that stands for each byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_bytes(token: str, char_to_byte: dict[str, int]) -> bytes:
    try:
        return bytes(char_to_byte[c] for c in token)
    except KeyError:  # not a byte-level string (an added token): the decoder keeps it as text
        return token.encode("utf-8")


def byte_level_tables(backend: Any) -> dict[bool, tuple[bytes, ...]] | None:
    """``{skip_special_tokens: table}`` with ``table[id]`` the bytes id stands for (``b""`` for a
    special token when skipping them, and for an id without a token), or None when ``backend`` (a
    ``tokenizers.Tokenizer``) does not decode as a plain byte-level table would."""
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder")
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    char_to_byte = _unicode_to_byte()
    special = {t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
    tokens = [backend.id_to_token(i) for i in range(size)]
    full = tuple(b"" if t is None else _token_bytes(t, char_to_byte) for t in tokens)
    skipping = tuple(b"" if i in special else b for i, b in enumerate(full))
    tables = {False: full, True: skipping}
    rng = random.Random(0)
    short = [i for i, b in enumerate(full) if 0 < len(b) <= 2]  # lone and split UTF-8 bytes live here
    sequences = [[rng.randrange(size) if rng.random() < 0.5 or not short else rng.choice(short)
                  for _ in range(rng.randint(1, _CHECK_LENGTH))] for _ in range(_CHECK_SEQUENCES)]
    for skip, table in tables.items():
        # Skipping changes only the special tokens: every other id alone is checked once, unskipped.
        singles = sorted(special) if skip else range(size)
        checks = [[i] for i in singles] + sequences
        got = backend.decode_batch(checks, skip_special_tokens=skip)
        for ids, text in zip(checks, got):
            if b"".join(table[i] for i in ids).decode("utf-8", "replace") != text:
                return None
    return tables
