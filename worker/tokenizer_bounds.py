"""How many bytes of text one token can stand for, read off a ``tokenizer.json``.

A text of ``b`` UTF-8 bytes encodes to at least ``ceil(b / B)`` tokens when no token covers more
than ``B`` bytes of the input, so a prompt over ``max_model_len x B`` bytes cannot fit and is refused
before it is tokenized (:func:`max_bytes_per_token`). ``B`` is the longest token (in the bytes of the
text the model sees) times how much the normalizer can shrink the text before the model sees it.

The bound must never be too small: any stage that can drop text (a normalizer that strips or
replaces with nothing, a pre-tokenizer that removes whitespace, a model whose unknown token can
stand for a whole word, truncation) makes it unbounded, and the answer is None.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["max_bytes_per_token"]

#: Most UTF-8 bytes one character of the input can lose to a normalizer: NFKC maps the 4-byte
#: U+1D400 (mathematical bold A) to the 1-byte "A"; Lowercase maps the 3-byte Kelvin sign to "k".
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1, "ByteLevel": 1}

#: Pre-tokenizers that split the text without dropping any of it (Split and Punctuation unless their
#: behavior removes the delimiter).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}

#: Most bytes one unknown character stands for, when a BPE model maps each to its own unknown token.
_MAX_CHAR_BYTES = 4


def max_bytes_per_token(tokenizer_json: str) -> int | None:
    """Most UTF-8 bytes of input text one token can stand for, or None where no bound holds.

    ``tokenizer_json``: the serialized tokenizer (``tokenizers.Tokenizer.to_str()`` or the file).
    """
    spec = json.loads(tokenizer_json)
    if spec.get("truncation") is not None:
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    longest = _longest_model_token(spec.get("model") or {}, _byte_level(spec))
    if longest is None:
        return None
    added = [len(str(t.get("content", "")).encode()) for t in spec.get("added_tokens") or []]
    return max([shrink * longest, *(shrink * a for a in added), 1])


def _normalizer_shrink(node: dict[str, Any] | None) -> int | None:
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        total = 1
        for child in node.get("normalizers") or []:
            factor = _normalizer_shrink(child)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern, content = node.get("pattern") or {}, str(node.get("content", ""))
        if "String" not in pattern or not content:  # a regex, or a replacement by nothing, can drop anything
            return None
        return max(1, -(-len(str(pattern["String"]).encode()) // len(content.encode())))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_keeps_text(child) for child in node.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and node.get("behavior") != "Removed"


def _byte_level(spec: dict[str, Any]) -> bool:
    """Whether the vocabulary is byte-level (each character of a token string is one input byte)."""
    def has(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False
    return has(spec.get("pre_tokenizer")) and has(spec.get("decoder"))


def _longest_model_token(model: dict[str, Any], byte_level: bool) -> int | None:
    kind = model.get("type")
    vocab = model.get("vocab")
    if kind != "BPE" or not isinstance(vocab, dict):
        return None  # WordPiece, WordLevel and Unigram can map a whole word to one unknown token
    if model.get("unk_token") is not None and not model.get("byte_fallback") and model.get("fuse_unk"):
        return None  # a run of unknown characters becomes one token
    if byte_level:  # one character per input byte
        longest = max((len(t) for t in vocab), default=1)
    else:  # overcounts: Metaspace's "▁" (3 bytes) stands for a space, "<0x41>" for one byte, "##" for none
        longest = max((len(t.encode()) for t in vocab), default=1)
    return max(longest, _MAX_CHAR_BYTES if model.get("unk_token") is not None else 1)
