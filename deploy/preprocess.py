"""Request preprocessing: an API request's body becomes a :class:`PreparedRequest`, off the replica's loop.

:func:`prepare` is the one path from body bytes to what the fleet is given: parse the JSON, validate
the fields, check every bound that needs no tokenizer (choices, stop sequences, a text that cannot
fit in ``max_model_len`` tokens), render the chat template, tokenize, admit each prompt
(:class:`worker.admission.PromptLimits`) and build each prompt's :class:`SamplingParams`. Each
problem is a 400 naming its field.

Parsing a large JSON body, rendering a template and tokenizing all hold the GIL of the process they
run in, for as long as the body is large: the replica, whose event loop answers ``/health`` and
Serve's health check and whose fleet loop thread steps every group, runs none of it.
:class:`deploy.preprocess_pool.Preprocessor` runs :func:`prepare` in a pool of processes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from deploy import openai_protocol as p
from deploy.errors import ApiError
from deploy.request_fields import UnsupportedField, check_fields
from worker.admission import PromptLimits, PromptTooLong
from worker.request import RequestRejected
from worker.sampling.params import MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError
from worker.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["MAX_CHOICES", "MAX_STOP_CHARS", "MAX_STOP_SEQUENCES", "PreparedRequest", "from_validation", "prepare",
           "rejected"]

#: Most token ids ``stop_token_ids`` may list (each sampled token is looked up in them).
MAX_STOP_TOKEN_IDS = 64
#: Most entries ``logit_bias`` may have (each is a scattered add on the device every step).
MAX_LOGIT_BIAS = 1024
#: Most choices one request may ask for: prompts times ``n``.
MAX_CHOICES = 16
#: Most stop sequences one request may give, and most characters in each (every generated token is
#: matched against each of them).
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024

ROUTES = {"completions": p.CompletionRequest, "chat": p.ChatCompletionRequest}


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to submit: its validated fields (``prompt`` / ``messages`` emptied, the prompts
    are in ``prompts``), each prompt's admitted token ids, and the SamplingParams of each choice
    (``n`` per prompt, in order; the choices of a seeded request get seeds ``seed + k``)."""

    request: p.CompletionRequest | p.ChatCompletionRequest
    prompts: list[list[int]]
    choices: list[tuple[int, SamplingParams]]  # (index into prompts, params)
    #: completions ``echo``: each prompt's text, sent before its choices' text (None: no echo)
    echo_texts: list[str] | None = None
    #: ``echo`` with ``max_tokens: 0``: the choices generate one token that the answer leaves out
    #: (the prompt's log-probabilities come from the prefill, which needs a sampled row to finish)
    prompt_only: bool = False

    @property
    def logprobs(self) -> bool:
        """Whether the choices return the chosen tokens' log-probabilities (all or none do)."""
        return self.choices[0][1].logprobs


def prepare(route: str, raw: bytes, tokenizer: Tokenizer | None, limits: PromptLimits) -> PreparedRequest:
    """The :class:`PreparedRequest` of body ``raw`` for ``route`` (``completions`` or ``chat``); raises
    :class:`ApiError` (400) naming the first problem."""
    req = _parse(raw, ROUTES[route], limits)
    fields = _sampling_fields(req, limits)
    echo_texts, prompt_only = None, False
    if route == "completions":
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] or null, got {req.logprobs}",
                           param="logprobs")
        _check_choices(_num_prompts(req.prompt), req.n)
        prompts = _completion_prompts(req.prompt, tokenizer, limits)
        max_tokens, emptied = req.max_tokens, {"prompt": []}
        if req.echo:  # OpenAI's echo: the prompt's text first, with its tokens' log-probabilities
            echo_texts = _echo_texts(req.prompt, prompts, tokenizer)
            fields["prompt_logprobs"] = req.logprobs
            prompt_only = max_tokens == 0
            max_tokens = 1 if prompt_only else max_tokens
    else:
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or null, got {req.top_logprobs}",
                           param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        _check_choices(1, req.n)
        prompts = [_chat_prompt(req.messages, tokenizer, limits)]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        emptied = {"messages": []}
    fields["max_tokens"] = max_tokens
    choices = []
    for i, ids in enumerate(prompts):
        params = _sampling(fields, len(ids), limits.max_model_len)
        for k in range(req.n):
            # Choices of one seeded request must differ, yet stay reproducible.
            seed = None if params.seed is None or req.n == 1 else (params.seed + k) % (1 << 64)
            choices.append((i, params if seed is None else replace(params, seed=seed)))
    return PreparedRequest(req.model_copy(update=emptied), prompts, choices, echo_texts, prompt_only)


def _echo_texts(prompt: Any, prompts: list[list[int]], tokenizer: Tokenizer | None) -> list[str]:
    """Each prompt as echoed: a text prompt as sent, token ids decoded (vLLM's)."""
    given = [prompt] if isinstance(prompt, str) else prompt
    if all(isinstance(x, int) for x in given):
        given = [given]
    return [x if isinstance(x, str) else (tokenizer.decode(ids) if tokenizer is not None else "")
            for x, ids in zip(given, prompts)]


# ----- parsing -----

def _parse(raw: bytes, model: type[p.BaseModel], limits: PromptLimits) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    _check_prompt_lists(data.get("prompt"), limits)
    try:
        check_fields(data, set(model.model_fields), model.__name__)
    except UnsupportedField as e:
        raise ApiError(400, e.message, param=e.field) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e.errors()) from None


def from_validation(errors: Sequence[dict]) -> ApiError:
    """The first pydantic error as an ApiError naming the field (``messages.0.role``)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union members add their type name to the location (``prompt.list[int].0``); keep the field path.
    loc = [x for x in loc if not _UNION_TAG.match(x)]
    param = ".".join(loc) or None
    got = first.get("input")
    shown = "" if got is None or first.get("type") == "missing" else f" (got {json.dumps(got, default=str)[:80]})"
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}{shown}", param=param)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")


# ----- bounds checked before any tokenizing -----

def _check_prompt_lists(prompt: Any, limits: PromptLimits) -> None:
    """Refuse, before validating them item by item, prompt lists too long to be admitted: more prompts than
    choices, or more token ids than ``max_model_len``."""
    if not isinstance(prompt, list) or not prompt:
        return
    if not isinstance(prompt[0], (str, list)):  # one prompt of token ids (validation names a wrong type)
        if len(prompt) >= limits.max_model_len:
            raise rejected(PromptTooLong(len(prompt), limits.max_model_len), "prompt")
        return
    _check_choices(len(prompt), 1)
    for i, ids in enumerate(prompt):
        if isinstance(ids, list) and len(ids) >= limits.max_model_len:
            raise rejected(PromptTooLong(len(ids), limits.max_model_len), f"prompt[{i}]")


def _num_prompts(prompt: Any) -> int:
    """How many prompts ``prompt`` holds: a string or a list of token ids is one, a list of either is many."""
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def _check_choices(num_prompts: int, n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in 1..{MAX_CHOICES}, got {n}", param="n")
    if num_prompts * n > MAX_CHOICES:
        raise ApiError(400, f"{num_prompts} prompts x n={n} asks for {num_prompts * n} choices; at most "
                            f"{MAX_CHOICES}", param="n")


def _check_text_fits(text: str, tokenizer: Tokenizer, limits: PromptLimits, param: str) -> None:
    """Refuse a text that cannot fit before tokenizing it: no token stands for more than
    ``tokenizer.max_bytes_per_token`` bytes, so ``max_model_len`` tokens hold at most that many times."""
    per_token = tokenizer.max_bytes_per_token
    if per_token is None or len(text) * 4 <= limits.max_model_len * per_token:  # 4: most bytes a char takes
        return
    size, most = len(text.encode("utf-8", "surrogatepass")), limits.max_model_len * per_token
    if size > most:
        raise ApiError(400, f"{param}: the text is {size} bytes; no token of this model stands for more than "
                            f"{per_token} bytes, so at most {most} bytes fit in max_model_len={limits.max_model_len} "
                            "tokens", param=param, code="context_length_exceeded")


def _sampling_fields(req: p._SamplingFields, limits: PromptLimits) -> dict:
    """SamplingParams fields of ``req`` but ``max_tokens`` (filled per prompt)."""
    if isinstance(req, p.ChatCompletionRequest):
        logprobs, top = req.logprobs, (req.top_logprobs or 0) if req.logprobs else 0
    else:
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    fields: dict[str, Any] = {"ignore_eos": req.ignore_eos, "logprobs": logprobs, "top_logprobs": top}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop is not None:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
        if len(stop) > MAX_STOP_SEQUENCES:
            raise ApiError(400, f"stop has {len(stop)} sequences; at most {MAX_STOP_SEQUENCES}", param="stop")
        for i, s in enumerate(stop):
            if len(s) > MAX_STOP_CHARS:
                raise ApiError(400, f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS}", param="stop")
        fields["stop"] = stop
    if req.stop_token_ids:
        ids = req.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ApiError(400, f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                           param="stop_token_ids")
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"stop_token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})",
                           param="stop_token_ids")
        fields["stop_token_ids"] = tuple(ids)
    if req.logit_bias:
        fields["logit_bias"] = _logit_bias(req.logit_bias, limits)
    return fields


def _logit_bias(bias: dict[str, float], limits: PromptLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings) as SamplingParams takes it; a 400 naming the field
    for too many entries, an id that is no integer or not in the vocabulary, or a bias out of [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= tok < limits.vocab_size:
            raise ApiError(400, f"logit_bias: token id {tok} is outside the vocabulary [0, {limits.vocab_size})",
                           param="logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key}] must be in [-100, 100], got {value}", param="logit_bias")
        pairs.append((tok, float(value)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise ApiError(400, "logit_bias names a token id twice", param="logit_bias")
    return tuple(pairs)


# ----- prompts -----

def rejected(e: RequestRejected, param: str) -> ApiError:
    """The 400 of a request the fleet would refuse, naming the field ``param``."""
    code = "context_length_exceeded" if isinstance(e, PromptTooLong) else None
    return ApiError(400, f"{param}: {e}", param=param, code=code)


def _admitted(ids: list[int], limits: PromptLimits, param: str) -> list[int]:
    try:
        limits.check(ids)
    except RequestRejected as e:
        raise rejected(e, param) from None
    return ids


def _completion_prompts(prompt: Any, tokenizer: Tokenizer | None, limits: PromptLimits) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [_admitted(list(prompt), limits, "prompt")]
    if tokenizer is None and any(isinstance(x, str) for x in prompt):
        raise ApiError(400, "this model has no tokenizer: send prompt as token ids", param="prompt")
    for i, x in enumerate(prompt):
        if not x:
            raise ApiError(400, f"prompt[{i}] is empty", param="prompt")
        if isinstance(x, str):
            _check_text_fits(x, tokenizer, limits, f"prompt[{i}]")
    return [_admitted(tokenizer.encode(x) if isinstance(x, str) else list(x), limits, f"prompt[{i}]")
            for i, x in enumerate(prompt)]


def _chat_prompt(messages: list[p.ChatMessage], tokenizer: Tokenizer | None, limits: PromptLimits) -> list[int]:
    if not messages:
        raise ApiError(400, "messages is empty: give at least one message", param="messages")
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so no chat template: use /v1/completions",
                       param="messages")
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except (ChatTemplateError, TypeError) as e:
        raise ApiError(400, f"messages: the chat template rejected the conversation: {e}",
                       param="messages") from None
    _check_text_fits(text, tokenizer, limits, "messages")
    # The rendered template already holds the special tokens (BOS), as in vLLM.
    return _admitted(tokenizer.encode(text, add_special_tokens=False), limits, "messages")


def _sampling(fields: dict, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams for one admitted prompt (so at least one token fits after it)."""
    room = max_model_len - prompt_len
    fields = dict(fields)
    if fields["max_tokens"] is None:
        fields["max_tokens"] = room
    try:
        params = SamplingParams(**fields)
    except SamplingParamsError as e:
        raise ApiError(400, str(e), param=str(e).split(" ", 1)[0].split("[", 1)[0]) from None
    if params.max_tokens > room:
        raise ApiError(400, f"max_tokens is {params.max_tokens}, but the prompt has {prompt_len} tokens and this "
                            f"model's maximum context length is {max_model_len}: at most {room} can be generated",
                       param="max_tokens", code="context_length_exceeded")
    return params
