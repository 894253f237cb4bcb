"""Prompt admission: what a prompt must be before any engine, fleet or API queues it.

One check, one message per problem, used by :class:`worker.engine.Engine`, :class:`fleet.fleet.Fleet`
and the HTTP API (which answers each problem with a 400 naming the request field).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.request import RequestRejected
from worker.tokenizer import Tokenizer


class NoTokenizer(RequestRejected):
    """A text prompt for a checkpoint without ``tokenizer.json``."""


class EmptyPrompt(RequestRejected):
    """A prompt of no tokens."""


class TokenOutsideVocabulary(RequestRejected):
    """A prompt token id that is not in ``[0, vocab_size)``."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"prompt token id {token_id} outside the vocabulary [0, {vocab_size})")
        self.token_id, self.vocab_size = token_id, vocab_size


class BiasOutsideVocabulary(RequestRejected):
    """A ``logit_bias`` token id that is not in ``[0, vocab_size)`` (on the device it would index
    past the logits)."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"logit_bias token id {token_id} outside the vocabulary [0, {vocab_size})")
        self.token_id, self.vocab_size = token_id, vocab_size


class PromptTooLong(RequestRejected):
    """A prompt that leaves no room for one generated token within ``max_model_len``."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(f"prompt has {num_tokens} tokens; max_model_len is {max_model_len}, the maximum context "
                         "length (prompt plus at least one generated token must fit)")
        self.num_tokens, self.max_model_len = num_tokens, max_model_len


def encode_prompt(prompt: str | Sequence[int], tokenizer: Tokenizer | None) -> list[int]:
    """The token ids of ``prompt``: text encoded by ``tokenizer`` (:class:`NoTokenizer` without one), or the ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise NoTokenizer("this checkpoint has no tokenizer.json: pass token ids")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must satisfy: a model's vocabulary size and its ``max_model_len``."""

    vocab_size: int
    max_model_len: int

    def check(self, ids: Sequence[int]) -> None:
        """Raise :class:`EmptyPrompt`, :class:`TokenOutsideVocabulary` (the first bad id) or
        :class:`PromptTooLong`, checked in that order; return if ``ids`` may be queued."""
        if not ids:
            raise EmptyPrompt("prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise TokenOutsideVocabulary(bad, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(len(ids), self.max_model_len)

    def check_params(self, params) -> None:
        """Raise :class:`BiasOutsideVocabulary` for a ``logit_bias`` id this model does not have."""
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise BiasOutsideVocabulary(bad, self.vocab_size)
