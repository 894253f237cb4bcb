"""Request fields beyond the ones this server serves: refused with a 400 naming them, or ignored on purpose.

OpenAI's API and vLLM's extensions define fields this server does not implement yet. Dropping one
silently would answer a different request than the one sent (a ``bad_words`` list, a
``response_format`` asking for JSON), so a request that sets one of :data:`UNSUPPORTED` to anything
but its no-op value gets a 400 naming the field. :data:`IGNORED` are accepted and have no effect,
each for the reason given (the README lists them). A field nobody here knows is ignored and logged
once per name, as vLLM does: clients send vendor fields of other servers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)


def _unset(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None


def _empty(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _one_of(*noops: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    def check(value: Any, body: Mapping[str, Any]) -> bool:
        return value is None or any(value == n and type(value) is type(n) for n in noops)
    return check


def _text_format(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text")


def _min_tokens(value: Any, body: Mapping[str, Any]) -> bool:
    # With ignore_eos and no stop strings every choice runs to max_tokens: any min_tokens holds.
    return value is None or value == 0 or (body.get("ignore_eos") is True and not body.get("stop"))


#: field -> (whether a value is the field's no-op, what the server cannot do). OpenAI's fields first,
#: then vLLM's extensions.
UNSUPPORTED: dict[str, tuple[Callable[[Any, Mapping[str, Any]], bool], str]] = {
    "suffix": (_empty, "insertion after the completion is not supported"),
    "best_of": (_one_of(1), "only one candidate a choice is generated (use n)"),
    "tools": (_empty, "tool calling is not supported"),
    "tool_choice": (_one_of("none"), "tool calling is not supported"),
    "functions": (_empty, "function calling is not supported"),
    "function_call": (_one_of("none"), "function calling is not supported"),
    "response_format": (_text_format, "only text output is produced (no JSON mode or schema)"),
    "audio": (_unset, "audio output is not supported"),
    "modalities": (_one_of(["text"]), "only text output is produced"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "min_tokens": (_min_tokens, "a minimum length is not enforced (only ignore_eos without stop strings runs "
                                "every choice to max_tokens)"),
    "bad_words": (_empty, "banned words are not supported"),
    "allowed_token_ids": (_unset, "restricting the vocabulary is not supported"),
    "include_stop_str_in_output": (_one_of(False), "the matched stop string is always cut from the output"),
    "skip_special_tokens": (_one_of(True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": (_one_of(True), "special tokens are always left out of the text"),
    "prompt_logprobs": (_unset, "prompt log-probabilities are not computed yet"),
    "use_beam_search": (_one_of(False), "beam search is not supported"),
    "length_penalty": (_one_of(1, 1.0), "beam search is not supported"),
    "guided_json": (_unset, "structured output is not supported"),
    "guided_regex": (_unset, "structured output is not supported"),
    "guided_choice": (_unset, "structured output is not supported"),
    "guided_grammar": (_unset, "structured output is not supported"),
    "structured_outputs": (_unset, "structured output is not supported"),
    "add_generation_prompt": (_one_of(True), "the chat template always ends with the assistant's turn"),
    "continue_final_message": (_one_of(False), "the chat template always ends with the assistant's turn"),
    "chat_template": (_unset, "the checkpoint's own chat template is used"),
    "chat_template_kwargs": (_empty, "the checkpoint's own chat template is used"),
    "truncate_prompt_tokens": (_unset, "prompts are never truncated (too long is a 400)"),
}

#: Accepted and without effect, on purpose.
IGNORED: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; nothing here monitors it (vLLM ignores it too)",
    "store": "responses are not stored",
    "metadata": "responses are not stored, so there is nothing to tag",
    "service_tier": "there is one tier",
    "parallel_tool_calls": "without tools there is nothing to call in parallel",
}

_logged: set[str] = set()


def check_fields(body: Mapping[str, Any], served: set[str], route: str) -> None:
    """Refuse ``body`` if it sets an unsupported field (``ValueError(field, message)``); log each
    field outside ``served``, :data:`UNSUPPORTED` and :data:`IGNORED` once per process."""
    for name, value in body.items():
        if name in served:
            continue
        rule = UNSUPPORTED.get(name)
        if rule is not None:
            noop, why = rule
            if not noop(value, body):
                raise UnsupportedField(name, f"{name} is not supported by this server: {why}")
        elif name not in IGNORED and name not in _logged:
            _logged.add(name)
            log.warning("%s request field %r is not a field this server knows; it is ignored", route, name)


class UnsupportedField(ValueError):
    """A request field set to a value this server cannot honour."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
