"""Request preprocessing: an API request's body becomes a :class:`PreparedRequest`, off the replica's loop.

:func:`prepare` is the one path from body bytes to what the fleet is given: parse the JSON, validate
the fields, check every bound that needs no tokenizer (choices, stop sequences, a text that cannot
fit in ``max_model_len`` tokens), render the chat template, tokenize, admit each prompt
(:class:`worker.admission.PromptLimits`) and build each prompt's :class:`SamplingParams`. Each
problem is a 400 naming its field.

Parsing a large JSON body, rendering a template and tokenizing all hold the GIL of the process they
run in, for as long as the body is large: the replica, whose event loop answers ``/health`` and
Serve's health check and whose fleet loop thread steps every group, runs none of it. A
:class:`Preprocessor` runs :func:`prepare` in a pool of processes (``serve.preprocess_workers``),
each holding the checkpoint's tokenizer (the pool worker's one piece of state, set when it starts).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from typing import Any

from pydantic import ValidationError

from deploy import openai_protocol as p
from deploy.errors import ApiError
from worker.admission import PromptLimits, PromptTooLong
from worker.request import RequestRejected
from worker.sampling.params import SamplingParams, SamplingParamsError
from worker.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer

log = logging.getLogger("ray.serve").getChild("graphfleet")

__all__ = ["MAX_CHOICES", "MAX_STOP_CHARS", "MAX_STOP_SEQUENCES", "PreparedRequest", "Preprocessor",
           "from_validation", "prepare", "rejected"]

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

    @property
    def logprobs(self) -> bool:
        """Whether the choices return the chosen tokens' log-probabilities (all or none do)."""
        return self.choices[0][1].logprobs


def prepare(route: str, raw: bytes, tokenizer: Tokenizer | None, limits: PromptLimits) -> PreparedRequest:
    """The :class:`PreparedRequest` of body ``raw`` for ``route`` (``completions`` or ``chat``); raises
    :class:`ApiError` (400) naming the first problem."""
    req = _parse(raw, ROUTES[route], limits)
    fields = _sampling_fields(req)
    if route == "completions":
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.logprobs is not None and req.logprobs != 0:
            raise ApiError(400, f"logprobs must be 0 or null (alternative tokens are not computed), "
                                f"got {req.logprobs}", param="logprobs")
        _check_choices(_num_prompts(req.prompt), req.n)
        prompts = _completion_prompts(req.prompt, tokenizer, limits)
        max_tokens, emptied = req.max_tokens, {"prompt": []}
    else:
        if req.top_logprobs:
            raise ApiError(400, f"top_logprobs must be 0 or null (alternative tokens are not computed), "
                                f"got {req.top_logprobs}", param="top_logprobs")
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
    return PreparedRequest(req.model_copy(update=emptied), prompts, choices)


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


def _sampling_fields(req: p._SamplingFields) -> dict:
    """SamplingParams fields of ``req`` but ``max_tokens`` (filled per prompt)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (must be 0 or null)", param=name)
    logprobs = req.logprobs if isinstance(req, p.ChatCompletionRequest) else req.logprobs is not None
    fields: dict[str, Any] = {"ignore_eos": req.ignore_eos, "logprobs": logprobs}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
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
    return fields


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


# ----- the pool -----

#: Bodies larger than this go to a pool worker in shared memory instead of through the pool's pipe.
SHARED_BODY_BYTES = 256 * 1024
#: Most bodies one call to a pool worker prepares (see :class:`Preprocessor`).
MAX_BODIES_PER_CALL = 16
_worker_tokenizer: Tokenizer | None = None  # a pool worker's tokenizer, loaded once when it starts


def _start_worker(model_path: str, parent_pid: int) -> None:
    global _worker_tokenizer
    # A pool worker outlives a SIGKILLed replica (it holds its queue's write end too): end with it.
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="preprocess-parent-watch",
                     daemon=True).start()
    _worker_tokenizer = load_tokenizer(model_path)
    if _worker_tokenizer is not None:
        _ = _worker_tokenizer.max_bytes_per_token  # read the vocabulary once, before the first request


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _prepare_in_worker(route: str, raw: bytes | tuple[str, int], limits: PromptLimits) -> PreparedRequest | ApiError:
    if isinstance(raw, tuple):  # a large body, handed over in shared memory (see Preprocessor.prepare)
        raw = _read_shared(*raw)
    try:
        return prepare(route, raw, _worker_tokenizer, limits)
    except ApiError as e:
        return e


def _prepare_batch_in_worker(items: list[tuple[str, bytes, PromptLimits]]) -> list[Any]:
    """:func:`_prepare_in_worker` of each body; any other exception is that body's answer alone."""
    out: list[Any] = []
    for route, raw, limits in items:
        try:
            out.append(_prepare_in_worker(route, raw, limits))
        except Exception as e:  # noqa: BLE001 - raised again for its own request by the replica
            out.append(e)
    return out


def _read_shared(name: str, size: int) -> bytes:
    # Attaching registers the segment with the resource tracker, which a spawned worker shares with
    # the replica (a set of names: one entry); the replica unlinks it, and that unregisters it.
    shm = shared_memory.SharedMemory(name=name)
    try:
        return bytes(shm.buf[:size])
    finally:
        shm.close()


def _ready() -> bool:
    return True


class Preprocessor:
    """Runs :func:`prepare` in ``workers`` processes (spawned, each loading the tokenizer of checkpoint
    ``model_path`` once), so the replica's process spends on a request only the body's bytes.

    Bodies that arrive while every worker is busy wait on the replica's event loop and go to the
    next free worker together, at most :data:`MAX_BODIES_PER_CALL` in one call (what waits is shared
    across the free workers): one pool call costs the replica's executor threads and both processes
    a round trip whatever it carries: 64 bodies of 512 token ids sent at once took a median 82 ms
    through two workers one call each, 64 ms one body a call through this queue, 25 ms up to 16 a
    call, against 0.27-0.35 ms apiece to prepare (2-core CPU machine, 10 bursts each).
    A body's own failure is its answer alone. Bodies over :data:`SHARED_BODY_BYTES` go alone.

    A request whose worker dies (killed, out of memory) gets a 500 naming it, as does every body of
    that call; the pool is replaced, and later requests go on. :meth:`shutdown` ends the workers.
    """

    def __init__(self, model_path: str, workers: int) -> None:
        self._model_path, self._workers = str(model_path), workers
        self._pool = self._new_pool()
        # Event-loop state (touched only on the loop that runs prepare): bodies not yet handed to
        # a worker, and calls under way.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: collections.deque[tuple[str, bytes, PromptLimits, asyncio.Future]] = collections.deque()
        self._calls = 0

    def _new_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(self._model_path, os.getpid()))
        for _ in range(self._workers):  # start them now, not on the first requests
            pool.submit(_ready)
        return pool

    async def prepare(self, route: str, raw: bytes, limits: PromptLimits) -> PreparedRequest:
        """:func:`prepare` of ``raw`` in a worker; raises its :class:`ApiError`.

        A body over :data:`SHARED_BODY_BYTES` goes to the worker in shared memory: through the pool's
        pipe (64 KiB at a time, each piece a wake-up of both processes) a 10 MB body took 0.25-0.3 s
        on a 2-core machine, during which the streams of other requests stalled.
        """
        if len(raw) <= SHARED_BODY_BYTES:
            result = await self._batched(route, raw, limits)
        else:
            pool, shm = self._pool, shared_memory.SharedMemory(create=True, size=len(raw))
            try:
                shm.buf[:len(raw)] = raw
                result = await asyncio.wrap_future(pool.submit(_prepare_in_worker, route, (shm.name, len(raw)),
                                                               limits))
            except BrokenProcessPool:
                self._replace(pool)
                raise _died() from None
            finally:
                shm.close()
                shm.unlink()
        if isinstance(result, BaseException):
            raise result
        return result

    async def _batched(self, route: str, raw: bytes, limits: PromptLimits) -> Any:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (a test's next asyncio.run): the old one's calls are gone
            self._loop, self._calls = loop, 0
            self._waiting.clear()
        answer = loop.create_future()
        self._waiting.append((route, raw, limits, answer))
        self._dispatch()
        return await answer

    def _dispatch(self) -> None:
        """Hand what waits to the free workers, shared out, at most MAX_BODIES_PER_CALL a call."""
        while self._waiting and self._calls < self._workers:
            n = min(MAX_BODIES_PER_CALL, -(-len(self._waiting) // (self._workers - self._calls)))
            batch = [self._waiting.popleft() for _ in range(n)]
            batch = [item for item in batch if not item[3].done()]  # their requests were cancelled
            if not batch:
                continue
            pool = self._pool
            try:
                submitted = pool.submit(_prepare_batch_in_worker, [item[:3] for item in batch])
            except BrokenProcessPool:  # a worker died since the last call: this batch is not lost
                self._replace(pool)
                self._waiting.extendleft(reversed(batch))
                continue
            except RuntimeError:  # the pool was shut down
                _settle(batch, [ApiError(503, "the server is shutting down", "unavailable") for _ in batch])
                continue
            self._calls += 1
            call = asyncio.wrap_future(submitted)
            call.add_done_callback(lambda done, batch=batch, pool=pool: self._answer(done, batch, pool))

    def _answer(self, call: asyncio.Future, batch: list, pool: ProcessPoolExecutor) -> None:
        self._calls = max(0, self._calls - 1)
        if call.cancelled():
            results: list[Any] = [ApiError(503, "the server is shutting down", "unavailable") for _ in batch]
        elif isinstance(call.exception(), BrokenProcessPool):
            self._replace(pool)
            results = [_died() for _ in batch]
        elif call.exception() is not None:  # the call itself failed (its answers did not pickle, ...)
            e = call.exception()
            results = [ApiError(500, f"internal error preparing the request: {type(e).__name__}: {e}",
                                "internal_error") for _ in batch]
        else:
            results = call.result()
        _settle(batch, results)
        self._dispatch()

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            log.error("a request preprocessing process died; starting a new pool")
            pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(batch: list, results: list) -> None:
    """Each waiting request of ``batch`` gets its result (one cancelled meanwhile gets none)."""
    for (_, _, _, answer), result in zip(batch, results, strict=True):
        if not answer.done():
            answer.set_result(result)


def _died() -> ApiError:
    return ApiError(500, "internal error: the process preparing this request died (its body may be too "
                         "large to parse in memory); retry", "internal_error")
