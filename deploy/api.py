"""The OpenAI-compatible HTTP API over a :class:`fleet.fleet.Fleet` (a FastAPI app; see :func:`build_app`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` gives server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /live`` (the replica's liveness),
``GET /health`` (the fleet's readiness), ``GET /metrics``, ``POST /admin/replan`` (re-plan the
graph ladders live).
Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deploy import openai_protocol as p
from deploy.api_metrics import ApiMetrics
from deploy.errors import ApiError, generation_failed, server_aborted
from deploy.metrics_merge import merge_expositions
from deploy.preprocess import PreparedRequest, from_validation, rejected
from deploy.preprocess_pool import Preprocessor
from deploy.stream_pacing import StreamPacer
from deploy.streaming import (
    Echo,
    Job,
    StreamSettings,
    abort_unfinished,
    chat_logprobs,
    chat_stream,
    completion_logprobs,
    completion_stream,
    sse_response,
)
from fleet.fleet import FleetClosed, Overloaded
from worker.request import RequestRejected

log = logging.getLogger(__name__)

__all__ = ["ApiError", "build_app"]

#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1
#: Seconds a ``/metrics`` scrape waits for the ranks' graph metrics.
RANK_METRICS_TIMEOUT_S = 2.0
#: Seconds ``POST /admin/replan`` waits for every group to capture its new ladders.
REPLAN_TIMEOUT_S = 900.0


def build_app(fleet, tokenizer, config, preprocessor: Preprocessor) -> FastAPI:
    """The FastAPI app serving ``fleet``.

    ``preprocessor`` turns request bodies into prepared requests (parsed, tokenized, admitted) in
    processes of its own; ``tokenizer`` spells logprob tokens;
    ``config`` is the :class:`deploy.config.Config` (its ``serve`` section: ``api_key``,
    ``model_name``, ``request_timeout_s``, ``stream_batching_interval_ms``, ``stream_chunks_per_s``).
    """
    serve_cfg = config.serve
    model_name = serve_cfg.model_name or Path(config.model.path).name
    api_key = serve_cfg.api_key
    metrics = ApiMetrics(model_name)
    created = p.now()
    pacer = StreamPacer(serve_cfg.stream_batching_interval_ms / 1e3, serve_cfg.stream_chunks_per_s)
    metrics.stream_interval.set_function(pacer.interval_s)

    def stream_settings(req: p.CompletionRequest | p.ChatCompletionRequest) -> StreamSettings:
        opts = req.stream_options or p.StreamOptions()  # continuous usage only with usage, as vLLM's
        return StreamSettings(opts.include_usage, bool(opts.include_usage and opts.continuous_usage_stats), pacer)
    app = FastAPI(title="graphfleet", description="OpenAI-compatible API of a graphfleet fleet")

    # ----- errors -----

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return from_validation(e.errors()).response()

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

    @app.get("/live")
    async def live() -> JSONResponse:
        """Liveness of this replica: 200 whenever its HTTP app and event loop answer, whatever the fleet's
        state (starting, capturing, degraded, draining, stopped, dead). It asks the fleet nothing, so it
        cannot block on it; whether the fleet serves is ``/health``'s answer."""
        return JSONResponse({"status": "alive"})

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness of the fleet: 200 when every group is ready (or degraded: serving while a group
        restarts), else 503 (starting, draining, stopped, dead).

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

    @app.post("/admin/replan")
    async def replan(request: Request) -> JSONResponse:
        """Re-plan every ready group's CUDA-graph ladders from the batches it has run, live
        (:meth:`fleet.fleet.Fleet.replan`); needs the API key when one is set. 200 with each group's
        result (ladders before and after, bytes, seconds, padding per step) when at least one group
        re-planned; 409 naming why when none did."""
        check_auth(request)
        try:
            groups = await asyncio.to_thread(fleet.replan, REPLAN_TIMEOUT_S)
        except FleetClosed as e:
            raise ApiError(503, str(e), "service_unavailable", code="fleet_closed") from e
        except TimeoutError as e:
            raise ApiError(504, str(e), "timeout_error", code="replan_timeout") from e
        done = {gid: g for gid, g in groups.items() if "error" not in g}
        for gid, g in groups.items():
            log.info("re-plan of %s: %s", gid, g.get("line") or g.get("error"))
        if not done:
            why = "; ".join(f"{gid}: {g['error']}" for gid, g in groups.items()) or "the fleet has no groups"
            raise ApiError(409, f"no group re-planned its graphs ({why})", "conflict_error", code="replan_refused")
        return JSONResponse({"object": "graph_replan", "replanned": sorted(done), "groups": groups})

    # ----- API -----

    async def accept(request: Request, route: str) -> PreparedRequest:
        """Authenticate, require a ready fleet, prepare the body (in the preprocessing pool) and check the
        model name."""
        check_auth(request)
        check_ready()
        try:
            body = await preprocessor.read(request.stream())
        except ClientDisconnect:
            metrics.rejected.labels(reason="client_closed").inc()
            raise ApiError(499, "the client closed the connection before it sent the whole body",
                           code="client_closed") from None
        except asyncio.CancelledError:
            # Serve cancels the request when its client goes away behind the proxy; with the API on
            # Serve's own loop (not the default) that arrives here as the task's cancellation.
            metrics.rejected.labels(reason="client_closed").inc()
            raise
        prepared = await preprocessor.prepare(route, body, fleet.prompt_limits)
        check_model(prepared.request.model)
        return prepared

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        check_ready()
        card = p.ModelCard(id=model_name, created=created, max_model_len=fleet.max_model_len)
        return _model_response(p.ModelList(data=[card]))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.monotonic()
        prepared = await accept(request, "completions")
        req = prepared.request
        jobs = _submit(fleet, prepared, "prompt", serve_cfg.request_timeout_s, metrics, arrived)
        rid, t0 = p.new_id("cmpl"), p.now()
        echo = None
        if prepared.echo_texts is not None:
            at = [i for i, _ in prepared.choices]
            echo = Echo({j.index: prepared.echo_texts[at[j.index]] for j in jobs},
                        {j.index: prepared.prompts[at[j.index]] for j in jobs}, prepared.prompt_only)
        if req.stream:
            return sse_response(completion_stream(jobs, rid, t0, model_name, stream_settings(req), metrics, tokenizer,
                                                  prepared.logprobs, echo))
        outs = await _results(jobs, metrics)
        choices = []
        for j, o in zip(jobs, outs):
            if echo is None:
                text, lp = o.text, (completion_logprobs(tokenizer, o.token_ids, o.logprobs) if prepared.logprobs
                                    else None)
            else:
                text, lp = echo.choice(tokenizer, j.index, o.text, o.token_ids, o.logprobs, o.prompt_logprobs,
                                       prepared.logprobs)
            choices.append(p.CompletionChoice(index=j.index, text=text, finish_reason=o.finish_reason,
                                              stop_reason=o.stop_reason, logprobs=lp))
        return _model_response(p.CompletionResponse(id=rid, created=t0, model=model_name, choices=choices,
                                                    usage=_usage(jobs, outs, prepared.prompt_only)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic()
        prepared = await accept(request, "chat")
        req = prepared.request
        jobs = _submit(fleet, prepared, "messages", serve_cfg.request_timeout_s, metrics, arrived)
        rid, t0 = p.new_id("chatcmpl"), p.now()
        if req.stream:
            return sse_response(chat_stream(jobs, rid, t0, model_name, stream_settings(req), metrics, tokenizer,
                                            prepared.logprobs))
        outs = await _results(jobs, metrics)
        spelled = [chat_logprobs(tokenizer, o.token_ids, o.logprobs) if prepared.logprobs else None for o in outs]
        choices = [p.ChatChoice(index=j.index, message=p.ChatResponseMessage(content=o.text),
                                finish_reason=o.finish_reason, stop_reason=o.stop_reason, logprobs=lp)
                   for j, o, lp in zip(jobs, outs, spelled)]
        return _model_response(p.ChatCompletionResponse(id=rid, created=t0, model=model_name, choices=choices,
                                                        usage=_usage(jobs, outs)))

    return app


def _submit(fleet, prepared: PreparedRequest, param: str, timeout_s: float | None, metrics: ApiMetrics,
            arrived: float) -> list[Job]:
    """Submit every choice of ``prepared`` (the request arrived at ``arrived``, ``time.monotonic()``:
    its TTFT and latency count from then); all or none are queued."""
    jobs: list[Job] = []
    t0 = arrived
    try:
        for index, (i, params) in enumerate(prepared.choices):
            ids = prepared.prompts[i]
            jobs.append(Job(index, len(ids), fleet.submit(ids, params, timeout_s=timeout_s), t0))
    except Overloaded as e:
        abort_unfinished(jobs)
        metrics.rejected.labels(reason="overloaded").inc()
        raise ApiError(429, f"the server is overloaded: {e}; retry later", "rate_limit_error", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except RequestRejected as e:
        abort_unfinished(jobs)
        raise rejected(e, param) from None
    except FleetClosed as e:  # FleetDraining too: a request that passed the drain gate just before it closed
        abort_unfinished(jobs)
        raise ApiError(503, f"the server is shutting down: {e}", "service_unavailable", code="draining",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return jobs


# ----- responses -----

def _model_response(body: BaseModel) -> Response:
    """``body`` as a JSON response, serialized by pydantic's compiled encoder (an echoed prompt's
    log-probabilities run to thousands of entries: model_dump then json.dumps costs several times more)."""
    return Response(body.model_dump_json(), media_type="application/json")


def _usage(jobs: list[Job], outs, prompt_only: bool = False) -> p.Usage:
    prompt = sum(j.prompt_len for j in jobs)
    completion = 0 if prompt_only else sum(len(o.token_ids) for o in outs)
    return p.Usage.of(prompt, completion, sum(o.cached_tokens for o in outs))


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
