"""Server-sent event streams of the OpenAI API: one chunk per token event, usage, [DONE].

A request with ``n`` choices is ``n`` fleet requests (jobs) merged into one stream; closing
the stream (a client disconnect) aborts every job that has not finished.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from deploy import openai_protocol as p
from deploy.api_metrics import ApiMetrics
from deploy.errors import ApiError, generation_failed, server_aborted
from deploy.stream_pacing import StreamPacer
from worker.outputs import merge_events
from worker.sampling.packed_rows import alternatives


@dataclass
class Job:
    """One choice: its index, prompt length, the fleet's handle, its arrival time (``time.monotonic``)
    and how many of its token deliveries the metrics have seen."""

    index: int
    prompt_len: int
    handle: Any
    t0: float
    observed: int = 0

    def observe_tokens(self, metrics: ApiMetrics, upto: int | None = None) -> None:
        """Observe TTFT and inter-token gaps of token deliveries ``observed..upto`` (None: all so far),
        and the first token's time by phase with the TTFT."""
        times = self.handle.token_times
        first = self.observed == 0
        self.observed = metrics.token_times(self.t0, times, self.observed, len(times) if upto is None else upto)
        if first and self.observed > 0:
            metrics.first_token_phases(times[0] - self.t0, self.handle.submitted - self.t0, self.handle.engine_phases)


def abort_unfinished(jobs: list[Job]) -> None:
    for j in jobs:
        if not j.handle.finished:
            j.handle.abort()


def _token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


#: vLLM's floor for a log-probability in a response (JSON has no -inf)
_MIN_LOGPROB = -9999.0


def _entry(entry) -> tuple[float | None, zip | tuple]:
    """(logprob, (token id, logprob) pairs of the alternatives) of one token's entry in an event's
    ``logprobs``: a bare log-probability, or ``(logprob, ids, logprobs)`` with alternatives."""
    if isinstance(entry, tuple):
        return entry[0], zip(*alternatives(entry[1], entry[2]))
    return entry, ()


def _clamped(lp: float | None) -> float | None:
    return None if lp is None else max(lp, _MIN_LOGPROB)


def completion_logprobs(tokenizer, token_ids: Sequence[int], logprobs, offset: int = 0) -> p.CompletionLogprobs:
    """OpenAI's completions ``logprobs`` of ``token_ids``: each token's text, log-probability and
    ``top_logprobs`` (the chosen token and the alternatives asked for, as vLLM), and text offsets
    counted from ``offset`` (the text of the choice before these tokens)."""
    entries = [_entry(e) for e in logprobs] if logprobs else [(None, ())] * len(token_ids)
    tokens, chosen, tops, offsets = [], [], [], []
    for t, (lp, top) in zip(token_ids, entries):
        s = _token_text(tokenizer, t)
        tokens.append(s)
        chosen.append(_clamped(lp))
        alternatives = {s: _clamped(lp)} if lp is not None else {}
        for tid, tlp in top:
            alternatives.setdefault(_token_text(tokenizer, tid), _clamped(tlp))
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(s)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=chosen, top_logprobs=tops if logprobs else None,
                                text_offset=offsets)


def _text_end(lp: p.CompletionLogprobs, empty: int = 0) -> int:
    """The text offset just after ``lp``'s last token (``empty`` when it has none)."""
    return lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else empty


def echoed_logprobs(tokenizer, prompt_ids: Sequence[int], prompt_entries, token_ids: Sequence[int], logprobs,
                    ) -> p.CompletionLogprobs:
    """An echoed choice's completions ``logprobs``: the prompt's tokens (the first without a
    log-probability, null as OpenAI's; the others with their prefill entries,
    ``RequestOutput.prompt_logprobs``), then the generated ones."""
    first = _token_text(tokenizer, prompt_ids[0])
    prompt = completion_logprobs(tokenizer, prompt_ids[1:], prompt_entries, len(first))
    out = completion_logprobs(tokenizer, token_ids, logprobs, _text_end(prompt, len(first)))
    return p.CompletionLogprobs(tokens=[first, *prompt.tokens, *out.tokens],
                                token_logprobs=[None, *prompt.token_logprobs, *out.token_logprobs],
                                top_logprobs=[None, *(prompt.top_logprobs or []), *(out.top_logprobs or [])],
                                text_offset=[0, *prompt.text_offset, *out.text_offset])


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs) -> p.ChatLogprobs:
    """OpenAI's chat ``logprobs.content`` of ``token_ids``: each token with its log-probability,
    bytes and ``top_logprobs`` (the alternatives asked for, most likely first)."""
    entries = [_entry(e) for e in logprobs] if logprobs else [(None, ())] * len(token_ids)
    items = []
    for t, (lp, top) in zip(token_ids, entries):
        s = _token_text(tokenizer, t)
        alternatives = []
        for tid, tlp in top:
            a = _token_text(tokenizer, tid)
            alternatives.append({"token": a, "logprob": _clamped(tlp), "bytes": list(a.encode())})
        items.append(p.ChatTokenLogprob(token=s, logprob=_clamped(lp), bytes=list(s.encode()),
                                        top_logprobs=alternatives))
    return p.ChatLogprobs(content=items)


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj: BaseModel | dict, exclude: set[str] | None = None) -> str:
    # A model serializes itself (pydantic's compiled encoder, compact as vLLM's chunks): 3.7 against
    # 8.9 us a chunk through model_dump and json.dumps on the 2-core CPU machine.
    return f"data: {obj.model_dump_json(exclude=exclude) if isinstance(obj, BaseModel) else json.dumps(obj)}\n\n"


@dataclass(frozen=True)
class StreamSettings:
    """How a response streams: usage after the last chunk (``stream_options.include_usage``) or in
    every chunk too (``stream_options.continuous_usage_stats``), and how often each choice's tokens
    go out (the replica's :class:`deploy.stream_pacing.StreamPacer`; None = as soon as they come)."""

    include_usage: bool = False
    continuous_usage: bool = False
    pacer: StreamPacer | None = None


async def _merged(jobs: list[Job], interval_s: float | Callable[[], float]) -> AsyncIterator[list[tuple[Job, Any]]]:
    """Each job's event batches (see ``RequestHandle.aevent_batches``) as they come, gathered into
    what is ready at once across the ``n`` choices; cancelling (client disconnect) aborts the
    unfinished ones."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for events in job.handle.aevent_batches(interval_s):
                q.put_nowait((job, events))
        except Exception as e:  # noqa: BLE001 (reported in the stream)
            q.put_nowait((job, e))
        finally:
            q.put_nowait((job, None))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    try:
        left = len(jobs)
        while left:
            ready = [await q.get()]
            while not q.empty():
                ready.append(q.get_nowait())
            left -= sum(item is None for _, item in ready)
            batch = [(job, item) for job, item in ready if item is not None]
            if batch:
                yield batch
    finally:
        for t in tasks:
            t.cancel()
        abort_unfinished(jobs)


class _StreamState:
    """Token counts of a streamed response (for usage) and its metrics."""

    def __init__(self, jobs: list[Job], metrics: ApiMetrics) -> None:
        self.jobs, self.metrics = jobs, metrics
        self.completion = {j.index: 0 for j in jobs}
        self.done: set[int] = set()

    def add(self, job: Job, ev, deliveries: int) -> None:
        """Count ``ev`` (``deliveries``: the tokens of the fleet events merged into it)."""
        if deliveries:
            job.observe_tokens(self.metrics, job.observed + deliveries)  # their delivery times
        self.completion[job.index] += len(ev.token_ids)
        if ev.finished:
            self.done.add(job.index)
            self.metrics.finished(job.t0, job.prompt_len, self.completion[job.index], ev.finish_reason)

    def usage(self) -> p.Usage:
        prompt = sum(j.prompt_len for j in self.jobs)
        completion = sum(self.completion.values())
        return p.Usage.of(prompt, completion, sum(j.handle.cached_tokens for j in self.jobs))

    def close(self) -> None:
        """Count the choices a disconnect cut short (their requests are aborted by :func:`_merged`)."""
        for j in self.jobs:
            if j.index not in self.done:
                self.done.add(j.index)
                self.metrics.finished(j.t0, j.prompt_len, self.completion[j.index], "abort")


def _stream_error(item: Exception | Any) -> str:
    """The SSE error event of a stream that raised ``item``, or whose final event ``item`` failed."""
    if isinstance(item, Exception):
        return _data(ApiError(500, f"the stream failed: {type(item).__name__}: {item}", "internal_error").body())
    return _data(generation_failed(item).body())


async def _stream(jobs: list[Job], metrics: ApiMetrics, chunk, opening: Sequence[BaseModel], usage_cls,
                  rid: str, created: int, model: str, settings: StreamSettings) -> AsyncIterator[str]:
    """The SSE body shared by both endpoints: ``opening`` chunks, one ``chunk(job, event)`` per
    batch of a choice's events (None skips it), an error event per failed job and after the final
    chunk of one the server aborted (a drain's timeout), usage, then ``[DONE]``.

    What is ready together goes out as one body write (still one SSE event per choice): under load
    that is one message through Serve's proxy per batch instead of one per token.
    """
    pacer = settings.pacer
    state, merged = _StreamState(jobs, metrics), _merged(jobs, pacer.interval_s if pacer is not None else 0.0)
    if pacer is not None:
        pacer.open(len(jobs))

    # A chunk has a "usage" key only when the request asked for usage (OpenAI's: null until the
    # last chunk, or each chunk's running count with continuous_usage_stats, vLLM's extension).
    no_usage = None if settings.include_usage else {"usage"}

    def data(body: BaseModel) -> str:
        if settings.continuous_usage:
            body = body.model_copy(update={"usage": state.usage()})
        return _data(body, no_usage)

    try:
        for first in opening:
            yield data(first)
        async for batch in merged:
            parts = []
            for job, item in batch:
                if isinstance(item, Exception):
                    parts.append(_stream_error(item))
                    continue
                failed = item[-1] if item[-1].finish_reason == "error" else None
                events = item[:-1] if failed is not None else item
                if events:
                    ev = merge_events(events)
                    state.add(job, ev, sum(len(e.token_ids) for e in events))
                    body = chunk(job, ev)
                    if body is not None:
                        parts.append(data(body))
                if failed is not None:
                    state.add(job, failed, len(failed.token_ids))
                    parts.append(_stream_error(failed))
                elif (aborted := server_aborted(item[-1])) is not None:  # after its "abort" chunk
                    parts.append(_data(aborted.body()))
            if parts:
                yield "".join(parts)
        if settings.include_usage:
            yield _data(usage_cls(id=rid, created=created, model=model, choices=[], usage=state.usage()))
        yield "data: [DONE]\n\n"
    finally:
        if pacer is not None:
            pacer.close(len(jobs))
        abort_unfinished(jobs)  # a disconnect: end the requests now, not at max_tokens
        state.close()
        await merged.aclose()


@dataclass(frozen=True)
class Echo:
    """Completions ``echo``: per choice index, its prompt's text and token ids; ``prompt_only``: the
    choices' generated token is left out (``max_tokens: 0``)."""

    texts: dict[int, str]
    prompt_ids: dict[int, list[int]]
    prompt_only: bool

    def choice(self, tokenizer, index: int, text: str, token_ids, logprobs, prompt_entries, want_logprobs,
               ) -> tuple[str, p.CompletionLogprobs | None]:
        """(text, logprobs) of choice ``index`` with its prompt in front."""
        if self.prompt_only:
            text, token_ids, logprobs = "", [], []
        lp = (echoed_logprobs(tokenizer, self.prompt_ids[index], prompt_entries, token_ids, logprobs)
              if want_logprobs else None)
        return self.texts[index] + text, lp


def completion_stream(jobs, rid, created, model, settings: StreamSettings, metrics, tokenizer,
                      want_logprobs, echo: Echo | None = None) -> AsyncIterator[str]:
    offsets: dict[int, int] = {}  # choice index -> characters of its tokens sent so far

    def chunk(job: Job, ev) -> BaseModel | None:
        lp, text = None, ev.text
        if echo is not None and job.index not in offsets:  # the choice's first chunk: the prompt first
            text, lp = echo.choice(tokenizer, job.index, text, ev.token_ids, ev.logprobs, ev.prompt_logprobs,
                                   want_logprobs)
            offsets[job.index] = _text_end(lp) if lp is not None else 0
        elif echo is not None and echo.prompt_only:
            text = ""
        elif want_logprobs and ev.token_ids:
            lp = completion_logprobs(tokenizer, ev.token_ids, ev.logprobs, offsets.get(job.index, 0))
            offsets[job.index] = _text_end(lp)
        if not text and not ev.finished and lp is None:
            return None
        choice = p.CompletionChoice(index=job.index, text=text, logprobs=lp,
                                    finish_reason=ev.finish_reason if ev.finished else None,
                                    stop_reason=ev.stop_reason if ev.finished else None)
        return p.CompletionResponse(id=rid, created=created, model=model, choices=[choice])

    return _stream(jobs, metrics, chunk, (), p.CompletionResponse, rid, created, model, settings)


def chat_stream(jobs, rid, created, model, settings: StreamSettings, metrics, tokenizer,
                want_logprobs) -> AsyncIterator[str]:
    def chunk(job: Job, ev) -> BaseModel | None:
        lp = chat_logprobs(tokenizer, ev.token_ids, ev.logprobs) if want_logprobs and ev.token_ids else None
        if not ev.text and not ev.finished and lp is None:
            return None
        choice = p.ChatChunkChoice(index=job.index, delta=p.ChatDelta(content=ev.text or None), logprobs=lp,
                                   finish_reason=ev.finish_reason if ev.finished else None,
                                   stop_reason=ev.stop_reason if ev.finished else None)
        return p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])

    opening = [p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[
        p.ChatChunkChoice(index=j.index, delta=p.ChatDelta(role="assistant", content=""))]) for j in jobs]
    return _stream(jobs, metrics, chunk, opening, p.ChatCompletionChunk, rid, created, model, settings)
