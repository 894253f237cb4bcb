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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.fleet import FleetClosed, Overloaded
from deploy import openai_protocol as p
from deploy.api_metrics import ApiMetrics
from deploy.errors import ApiError, generation_failed, server_aborted
from deploy.metrics_merge import merge_expositions
from deploy.streaming import (
    Job,
    StreamSettings,
    abort_unfinished,
    chat_logprobs,
    chat_stream,
    completion_logprobs,
    completion_stream,
    sse_response,
)
from worker.admission import PromptLimits, PromptTooLong
from worker.request import RequestRejected
from worker.sampling.params import SamplingParams, SamplingParamsError
from worker.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)

__all__ = ["MAX_N", "ApiError", "build_app"]

#: Most choices one request may ask for (``n``), times the number of prompts.
MAX_N = 16
#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1
#: Seconds a ``/metrics`` scrape waits for the ranks' graph metrics.
RANK_METRICS_TIMEOUT_S = 2.0


def build_app(fleet, tokenizer, config) -> FastAPI:
    """The FastAPI app serving ``fleet``.

    ``tokenizer`` encodes prompts, renders chat templates and spells logprob tokens;
    ``config`` is the :class:`deploy.config.Config` (its ``serve`` section: ``api_key``,
    ``model_name``, ``request_timeout_s``, ``stream_batching_interval_ms``).
    """
    serve_cfg = config.serve
    model_name = serve_cfg.model_name or Path(config.model.path).name
    api_key = serve_cfg.api_key
    metrics = ApiMetrics(model_name)
    created = p.now()
    interval_s = serve_cfg.stream_batching_interval_ms / 1e3

    def stream_settings(req: p.CompletionRequest | p.ChatCompletionRequest) -> StreamSettings:
        opts = req.stream_options or p.StreamOptions()
        return StreamSettings(opts.include_usage, opts.continuous_usage_stats, interval_s)
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
        """200 when every group is ready (or degraded: serving while a group restarts), else 503.

        ``groups``: each group's health (starting, capturing, ready, degraded, dead); ``phases``: where
        its current generation is in its life cycle (starting, capturing, ready, dead), also while
        it restarts. ``handoffs`` counts prefilled requests whose KV waits for a decode group;
        ``waiting`` names each group whose placement group waits for resources: what it asked for
        (bundle x count) and what the cluster has free.
        """
        h = fleet.health()
        groups = h.get("groups", {})
        body = {"status": h.get("status"), "groups": {gid: g.get("state") for gid, g in groups.items()},
                "phases": {gid: g.get("phase", g.get("state")) for gid, g in groups.items()},
                "queued": h.get("queued"), "handoffs": h.get("handoffs", 0), "in_flight": h.get("in_flight"),
                "waiting": {gid: g["waiting"] for gid, g in groups.items() if g.get("waiting")}}
        if h.get("error"):
            body["error"] = h["error"]
        return JSONResponse(body, status_code=200 if h.get("status") in ("ready", "degraded") else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The API's metrics and every rank's ``cuda_graph_*`` (labelled group, rank, role); ranks that
        do not answer within ``RANK_METRICS_TIMEOUT_S`` are left out of this scrape."""
        metrics.observe_fleet(fleet.health())
        ranks = await asyncio.to_thread(fleet.rank_metrics, RANK_METRICS_TIMEOUT_S)
        return Response(merge_expositions(metrics.registry, ranks), media_type=CONTENT_TYPE_LATEST)

    # ----- API -----

    async def accept(request: Request, model: type[BaseModel]) -> Any:
        """Authenticate, require a ready fleet, parse the body and check the model name."""
        check_auth(request)
        check_ready()
        req = await _parse(request, model)
        check_model(req.model)
        return req

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        check_ready()
        card = p.ModelCard(id=model_name, created=created, max_model_len=fleet.max_model_len)
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await accept(request, p.CompletionRequest)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.logprobs is not None and req.logprobs != 0:
            raise ApiError(400, f"logprobs must be 0 or null (alternative tokens are not computed), "
                                f"got {req.logprobs}", param="logprobs")
        prompts = _completion_prompts(req.prompt, tokenizer, fleet.prompt_limits)
        want_logprobs = req.logprobs is not None
        jobs = _submit(fleet, prompts, _params(req, req.max_tokens, want_logprobs), req.n, "prompt",
                       serve_cfg.request_timeout_s, metrics)
        rid, t0 = p.new_id("cmpl"), p.now()
        if req.stream:
            return sse_response(completion_stream(jobs, rid, t0, model_name, stream_settings(req), metrics, tokenizer,
                                                  want_logprobs))
        outs = await _results(jobs, metrics)
        choices = [p.CompletionChoice(index=j.index, text=o.text, finish_reason=o.finish_reason,
                                      logprobs=completion_logprobs(tokenizer, o) if want_logprobs else None)
                   for j, o in zip(jobs, outs)]
        return JSONResponse(p.CompletionResponse(id=rid, created=t0, model=model_name, choices=choices,
                                                 usage=_usage(jobs, outs)).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await accept(request, p.ChatCompletionRequest)
        if req.top_logprobs:
            raise ApiError(400, f"top_logprobs must be 0 or null (alternative tokens are not computed), "
                                f"got {req.top_logprobs}", param="top_logprobs")
        ids = _chat_prompt(req.messages, tokenizer, fleet.prompt_limits)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        jobs = _submit(fleet, [ids], _params(req, max_tokens, req.logprobs), req.n, "messages",
                       serve_cfg.request_timeout_s, metrics)
        rid, t0 = p.new_id("chatcmpl"), p.now()
        if req.stream:
            return sse_response(chat_stream(jobs, rid, t0, model_name, stream_settings(req), metrics, tokenizer,
                                            req.logprobs))
        outs = await _results(jobs, metrics)
        choices = [p.ChatChoice(index=j.index, message=p.ChatResponseMessage(content=o.text),
                                finish_reason=o.finish_reason,
                                logprobs=chat_logprobs(tokenizer, o.token_ids, o.logprobs) if req.logprobs else None)
                   for j, o in zip(jobs, outs)]
        return JSONResponse(p.ChatCompletionResponse(id=rid, created=t0, model=model_name, choices=choices,
                                                     usage=_usage(jobs, outs)).model_dump())

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


def _rejected(e: RequestRejected, param: str) -> ApiError:
    """The 400 of a request the fleet would refuse, naming the field ``param``."""
    code = "context_length_exceeded" if isinstance(e, PromptTooLong) else None
    return ApiError(400, f"{param}: {e}", param=param, code=code)


def _admitted(ids: list[int], limits: PromptLimits, param: str) -> list[int]:
    try:
        limits.check(ids)
    except RequestRejected as e:
        raise _rejected(e, param) from None
    return ids


def _completion_prompts(prompt: Any, tokenizer, limits: PromptLimits) -> list[list[int]]:
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
    return [_admitted(tokenizer.encode(x) if isinstance(x, str) else list(x), limits, f"prompt[{i}]")
            for i, x in enumerate(prompt)]


def _chat_prompt(messages: list[p.ChatMessage], tokenizer, limits: PromptLimits) -> list[int]:
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
    return _admitted(tokenizer.encode(text, add_special_tokens=False), limits, "messages")


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


def _submit(fleet, prompts: list[list[int]], fields: dict, n: int, param: str, timeout_s: float | None,
            metrics: ApiMetrics) -> list[Job]:
    """Validate everything, then submit ``n`` requests per prompt; all or none are queued."""
    if len(prompts) * n > MAX_N:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} asks for {len(prompts) * n} choices; at most {MAX_N}",
                       param="n")
    planned = []
    for ids in prompts:
        params = _sampling(fields, len(ids), fleet.max_model_len)
        for k in range(n):
            # Choices of one seeded request must differ, yet stay reproducible.
            seed = None if params.seed is None or n == 1 else (params.seed + k) % (1 << 64)
            planned.append((ids, params if seed is None else _replace_seed(params, seed)))
    jobs: list[Job] = []
    t0 = time.monotonic()
    try:
        for index, (ids, params) in enumerate(planned):
            jobs.append(Job(index, len(ids), fleet.submit(ids, params, timeout_s=timeout_s), t0))
    except Overloaded as e:
        abort_unfinished(jobs)
        metrics.rejected.labels(reason="overloaded").inc()
        raise ApiError(429, f"the server is overloaded: {e}; retry later", "rate_limit_error", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except RequestRejected as e:
        abort_unfinished(jobs)
        raise _rejected(e, param) from None
    except FleetClosed as e:  # FleetDraining too: a request that passed the drain gate just before it closed
        abort_unfinished(jobs)
        raise ApiError(503, f"the server is shutting down: {e}", "service_unavailable", code="draining",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return jobs


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


# ----- responses -----

def _usage(jobs: list[Job], outs) -> p.Usage:
    prompt = sum(j.prompt_len for j in jobs)
    completion = sum(len(o.token_ids) for o in outs)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _failed(outputs) -> ApiError | None:
    for o in outputs:
        if o.finish_reason == "error":
            return generation_failed(o)
        if (aborted := server_aborted(o)) is not None:
            return aborted
    return None


async def _results(jobs: list[Job], metrics: ApiMetrics) -> list:
    try:
        outs = await asyncio.gather(*(j.handle.aresult() for j in jobs))
    except FleetClosed as e:
        raise ApiError(503, f"the server is shutting down: {e}", "service_unavailable") from None
    finally:
        abort_unfinished(jobs)  # only unfinished ones: a cancelled (disconnected) request
    for j, o in zip(jobs, outs):
        j.observe_tokens(metrics)
        metrics.finished(j.t0, j.prompt_len, len(o.token_ids), o.finish_reason)
    err = _failed(outs)
    if err is not None:
        raise err
    return list(outs)
