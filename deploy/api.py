"""The OpenAI-compatible HTTP API over a :class:`cluster.fleet.Fleet` (a FastAPI app; see :func:`build_app`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` gives server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.fleet import FleetClosed, Overloaded
from deploy import openai_protocol as p
from deploy.api_metrics import ApiMetrics
from worker.request import RequestRejected
from worker.sampling.params import SamplingParams, SamplingParamsError
from worker.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)

__all__ = ["MAX_N", "ApiError", "build_app"]

#: Most choices one request may ask for (``n``), times the number of prompts.
MAX_N = 16
#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


@dataclass
class _Job:
    """One choice: its index, prompt length, and the fleet's handle."""

    index: int
    prompt_len: int
    handle: Any
    t0: float = 0.0


def build_app(fleet, tokenizer, config) -> FastAPI:
    """The FastAPI app serving ``fleet``.

    ``tokenizer`` encodes prompts, renders chat templates and spells logprob tokens;
    ``config`` is the :class:`deploy.config.Config` (its ``serve`` section: ``api_key``,
    ``model_name``, ``request_timeout_s``).
    """
    serve_cfg = config.serve
    model_name = serve_cfg.model_name or Path(config.model.path).name
    api_key = serve_cfg.api_key
    metrics = ApiMetrics(model_name)
    created = p.now()
    app = FastAPI(title="graphfleet", description="OpenAI-compatible API of a graphfleet fleet")

    # ----- errors -----

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _from_validation(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ApiError(e.status_code, str(e.detail), kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error").response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "invalid API key", "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_ready() -> None:
        if not getattr(fleet, "ready", True):
            h = fleet.health()
            raise ApiError(503, f"the fleet is not ready ({h.get('status')}"
                                f"{': ' + h['error'] if h.get('error') else ''}); retry later",
                           "service_unavailable", code="not_ready", headers={"Retry-After": str(RETRY_AFTER_S)})

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    # ----- open routes -----

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when every group is ready (or degraded: serving while a group restarts), else 503."""
        h = fleet.health()
        phases = {gid: g.get("state") for gid, g in h.get("groups", {}).items()}
        body = {"status": h.get("status"), "groups": phases, "queued": h.get("queued"),
                "in_flight": h.get("in_flight")}
        if h.get("error"):
            body["error"] = h["error"]
        return JSONResponse(body, status_code=200 if h.get("status") in ("ready", "degraded") else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.observe_fleet(fleet.health())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ----- API -----

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        check_ready()
        card = p.ModelCard(id=model_name, created=created, max_model_len=fleet.max_model_len)
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        check_ready()
        req = await _parse(request, p.CompletionRequest)
        check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.logprobs is not None and req.logprobs != 0:
            raise ApiError(400, f"logprobs must be 0 or null (alternative tokens are not computed), "
                                f"got {req.logprobs}", param="logprobs")
        prompts = _completion_prompts(req.prompt, tokenizer, fleet.vocab_size)
        want_logprobs = req.logprobs is not None
        jobs = _submit(fleet, prompts, _params(req, req.max_tokens, want_logprobs), req.n, "prompt",
                       serve_cfg.request_timeout_s, metrics)
        rid, t0 = p.new_id("cmpl"), p.now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_completion_stream(fleet, jobs, rid, t0, model_name, include_usage, metrics, tokenizer,
                                           want_logprobs))
        outs = await _results(jobs, metrics)
        choices = [p.CompletionChoice(index=j.index, text=o.text, finish_reason=o.finish_reason,
                                      logprobs=_completion_logprobs(tokenizer, o) if want_logprobs else None)
                   for j, o in zip(jobs, outs)]
        return JSONResponse(p.CompletionResponse(id=rid, created=t0, model=model_name, choices=choices,
                                                 usage=_usage(jobs, outs)).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        check_ready()
        req = await _parse(request, p.ChatCompletionRequest)
        check_model(req.model)
        if req.top_logprobs:
            raise ApiError(400, f"top_logprobs must be 0 or null (alternative tokens are not computed), "
                                f"got {req.top_logprobs}", param="top_logprobs")
        ids = _chat_prompt(req.messages, tokenizer, fleet.vocab_size)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        jobs = _submit(fleet, [ids], _params(req, max_tokens, req.logprobs), req.n, "messages",
                       serve_cfg.request_timeout_s, metrics)
        rid, t0 = p.new_id("chatcmpl"), p.now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_chat_stream(fleet, jobs, rid, t0, model_name, include_usage, metrics, tokenizer,
                                     req.logprobs))
        outs = await _results(jobs, metrics)
        choices = [p.ChatChoice(index=j.index, message=p.ChatResponseMessage(content=o.text),
                                finish_reason=o.finish_reason,
                                logprobs=_chat_logprobs(tokenizer, o.token_ids, o.logprobs) if req.logprobs else None)
                   for j, o in zip(jobs, outs)]
        return JSONResponse(p.ChatCompletionResponse(id=rid, created=t0, model=model_name, choices=choices,
                                                     usage=_usage(jobs, outs)).model_dump())

    app.state.fleet, app.state.metrics, app.state.model_name = fleet, metrics, model_name
    return app


# ----- request parsing -----

async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _from_validation(e.errors()) from None


def _from_validation(errors: Sequence[dict]) -> ApiError:
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


def _check_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise ApiError(400, f"{param} is empty", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param)
    return ids


def _completion_prompts(prompt: Any, tokenizer, vocab_size: int) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [_check_ids(list(prompt), vocab_size, "prompt")]
    if tokenizer is None and any(isinstance(x, str) for x in prompt):
        raise ApiError(400, "this model has no tokenizer: send prompt as token ids", param="prompt")
    for i, x in enumerate(prompt):
        if not x:
            raise ApiError(400, f"prompt[{i}] is empty", param="prompt")
    return [_check_ids(tokenizer.encode(x) if isinstance(x, str) else list(x), vocab_size, f"prompt[{i}]")
            for i, x in enumerate(prompt)]


def _chat_prompt(messages: list[p.ChatMessage], tokenizer, vocab_size: int) -> list[int]:
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
    # The rendered template already holds the special tokens (BOS), as in vLLM.
    return _check_ids(tokenizer.encode(text, add_special_tokens=False), vocab_size, "messages")


def _params(req: p._SamplingFields, max_tokens: int | None, logprobs: bool) -> dict:
    """SamplingParams fields of ``req`` (max_tokens None: up to max_model_len, filled per prompt)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (must be 0 or null)", param=name)
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in 1..{MAX_N}, got {req.n}", param="n")
    fields: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "logprobs": logprobs}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop is not None:
        fields["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    return fields


def _sampling(fields: dict, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(400, f"{param}: the prompt has {prompt_len} tokens; this model's maximum context length "
                            f"is {max_model_len} (prompt plus at least one generated token must fit)",
                       param=param, code="context_length_exceeded")
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


def _submit(fleet, prompts: list[list[int]], fields: dict, n: int, param: str, timeout_s: float | None,
            metrics: ApiMetrics) -> list[_Job]:
    """Validate everything, then submit ``n`` requests per prompt; all or none are queued."""
    if len(prompts) * n > MAX_N:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} asks for {len(prompts) * n} choices; at most {MAX_N}",
                       param="n")
    planned = []
    for ids in prompts:
        params = _sampling(fields, len(ids), fleet.max_model_len, param)
        for k in range(n):
            # Choices of one seeded request must differ, yet stay reproducible.
            seed = None if params.seed is None or n == 1 else (params.seed + k) % (1 << 64)
            planned.append((ids, params if seed is None else _replace_seed(params, seed)))
    jobs: list[_Job] = []
    try:
        for index, (ids, params) in enumerate(planned):
            jobs.append(_Job(index, len(ids), fleet.submit(ids, params, timeout_s=timeout_s)))
    except Overloaded as e:
        _abort(jobs)
        metrics.rejected.labels(reason="overloaded").inc()
        raise ApiError(429, f"the server is overloaded: {e}; retry later", "rate_limit_error", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except RequestRejected as e:
        _abort(jobs)
        raise ApiError(400, f"{param}: {e}", param=param) from None
    except FleetClosed as e:
        _abort(jobs)
        raise ApiError(503, f"the server is shutting down: {e}", "service_unavailable") from None
    for j in jobs:
        j.t0 = time.monotonic()
    return jobs


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _abort(jobs: list[_Job]) -> None:
    for j in jobs:
        if not j.handle.finished:
            j.handle.abort()


# ----- responses -----

def _usage(jobs: list[_Job], outs) -> p.Usage:
    prompt = sum(j.prompt_len for j in jobs)
    completion = sum(len(o.token_ids) for o in outs)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _failed(outputs) -> ApiError | None:
    for o in outputs:
        if o.finish_reason == "error":
            why = o.error or "the request failed"
            timeout = "deadline" in why or "timed out" in why or "timeout" in why
            return ApiError(504 if timeout else 500, f"generation failed: {why}",
                            "timeout_error" if timeout else "internal_error")
    return None


async def _results(jobs: list[_Job], metrics: ApiMetrics) -> list:
    try:
        outs = await asyncio.gather(*(asyncio.to_thread(j.handle.result) for j in jobs))
    except FleetClosed as e:
        raise ApiError(503, f"the server is shutting down: {e}", "service_unavailable") from None
    finally:
        _abort(jobs)  # only unfinished ones: a cancelled (disconnected) request
    for j, o in zip(jobs, outs):
        metrics.finished(j.t0, j.prompt_len, len(o.token_ids), o.finish_reason)
    err = _failed(outs)
    if err is not None:
        raise err
    return list(outs)


def _token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tokenizer, out) -> p.CompletionLogprobs:
    tokens = [_token_text(tokenizer, t) for t in out.token_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=list(out.logprobs or [None] * len(tokens)),
                                text_offset=offsets)


def _chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs) -> p.ChatLogprobs:
    lps = list(logprobs or [None] * len(token_ids))
    items = []
    for t, lp in zip(token_ids, lps):
        s = _token_text(tokenizer, t)
        items.append(p.ChatTokenLogprob(token=s, logprob=lp, bytes=list(s.encode())))
    return p.ChatLogprobs(content=items)


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj: BaseModel | dict) -> str:
    body = obj.model_dump(exclude_none=False) if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(body)}\n\n"


async def _merged(jobs: list[_Job]) -> AsyncIterator[tuple[_Job, Any]]:
    """Events of every job as they come; cancelling (client disconnect) aborts the unfinished ones."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(job: _Job) -> None:
        try:
            for_events = job.handle.events()
            while True:
                ev = await asyncio.to_thread(next, for_events, None)
                if ev is None:
                    break
                await q.put((job, ev))
        except Exception as e:  # noqa: BLE001 (reported in the stream)
            await q.put((job, e))
        finally:
            await q.put((job, None))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    try:
        left = len(jobs)
        while left:
            job, item = await q.get()
            if item is None:
                left -= 1
                continue
            yield job, item
    finally:
        for t in tasks:
            t.cancel()
        _abort(jobs)


class _StreamState:
    """Token counts of a streamed response (for usage) and its metrics."""

    def __init__(self, jobs: list[_Job], metrics: ApiMetrics) -> None:
        self.jobs, self.metrics = jobs, metrics
        self.completion = {j.index: 0 for j in jobs}
        self.done: set[int] = set()

    def add(self, job: _Job, ev) -> None:
        if ev.token_ids and self.completion[job.index] == 0:
            self.metrics.first_token(job.t0)
        self.completion[job.index] += len(ev.token_ids)
        if ev.finished:
            self.done.add(job.index)
            self.metrics.finished(job.t0, job.prompt_len, self.completion[job.index], ev.finish_reason)

    def close(self) -> None:
        """Count the choices a disconnect cut short (their requests are aborted by :func:`_merged`)."""
        for j in self.jobs:
            if j.index not in self.done:
                self.done.add(j.index)
                self.metrics.finished(j.t0, j.prompt_len, self.completion[j.index], "abort")


def _stream_error(item: Exception | Any) -> str:
    if isinstance(item, Exception):
        msg, kind = f"the stream failed: {type(item).__name__}: {item}", "internal_error"
    else:
        msg, kind = f"generation failed: {item.error or 'the request failed'}", "internal_error"
    return _data(ApiError(500, msg, kind).body())


async def _completion_stream(fleet, jobs, rid, created, model, include_usage, metrics, tokenizer,
                             want_logprobs) -> AsyncIterator[str]:
    state, merged = _StreamState(jobs, metrics), _merged(jobs)
    try:
        async for job, ev in merged:
            if isinstance(ev, Exception) or ev.finish_reason == "error":
                yield _stream_error(ev)
                continue
            state.add(job, ev)
            lp = None
            if want_logprobs and ev.token_ids:
                tokens = [_token_text(tokenizer, t) for t in ev.token_ids]
                lp = p.CompletionLogprobs(tokens=tokens, token_logprobs=list(ev.logprobs or [None] * len(tokens)))
            if not ev.text and not ev.finished and lp is None:
                continue
            choice = p.CompletionChoice(index=job.index, text=ev.text, logprobs=lp,
                                        finish_reason=ev.finish_reason if ev.finished else None)
            yield _data(p.CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
        if include_usage:
            yield _data(_final_usage(p.CompletionResponse, rid, created, model, jobs, state))
        yield "data: [DONE]\n\n"
    finally:
        _abort(jobs)  # a disconnect: end the requests now, not at max_tokens
        state.close()
        await merged.aclose()


async def _chat_stream(fleet, jobs, rid, created, model, include_usage, metrics, tokenizer,
                       want_logprobs) -> AsyncIterator[str]:
    state, merged = _StreamState(jobs, metrics), _merged(jobs)
    try:
        for j in jobs:
            first = p.ChatChunkChoice(index=j.index, delta=p.ChatDelta(role="assistant", content=""))
            yield _data(p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[first]))
        async for job, ev in merged:
            if isinstance(ev, Exception) or ev.finish_reason == "error":
                yield _stream_error(ev)
                continue
            state.add(job, ev)
            lp = _chat_logprobs(tokenizer, ev.token_ids, ev.logprobs) if want_logprobs and ev.token_ids else None
            if not ev.text and not ev.finished and lp is None:
                continue
            choice = p.ChatChunkChoice(index=job.index, delta=p.ChatDelta(content=ev.text or None), logprobs=lp,
                                       finish_reason=ev.finish_reason if ev.finished else None)
            yield _data(p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]))
        if include_usage:
            yield _data(_final_usage(p.ChatCompletionChunk, rid, created, model, jobs, state))
        yield "data: [DONE]\n\n"
    finally:
        _abort(jobs)  # a disconnect: end the requests now, not at max_tokens
        state.close()
        await merged.aclose()


def _final_usage(cls, rid, created, model, jobs, state) -> BaseModel:
    prompt = sum(j.prompt_len for j in jobs)
    completion = sum(state.completion.values())
    usage = p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return cls(id=rid, created=created, model=model, choices=[], usage=usage)
