"""From sampled tokens to request progress: detokenisation, stop and length decisions, hand-offs.

The step pipeline (:mod:`worker.step_pipeline`) hands every token it reads back to
:meth:`OutputProcessor.append_token`, which appends it to its request, extends the request's
output text, decides whether the request ends there (EOS, stop token, stop string, length, or a
hand-off after its first token) and returns the request's event; when the executor is gone,
:meth:`OutputProcessor.fail_all` ends every request with an error. vLLM calls this piece the
OutputProcessor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from worker.detokenizer import OutputText, append_each
from worker.outputs import RequestEvent
from worker.request import Request
from worker.scheduler import Scheduler
from worker.tokenizer import Tokenizer


class OutputProcessor:
    """Output state of the engine's requests (texts, hand-off callbacks, errors) and what each token decides.

    A request is known from :meth:`add` until :meth:`forget`. Requests that end here are finished
    through ``scheduler``, which frees their pages.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None, eos_token_ids: Collection[int],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.errors: dict[str, str] = {}  # request id -> why it ended with an error
        self._texts: dict[str, OutputText] = {}
        self._handoffs: dict[str, Callable[[Request], None]] = {}
        if tokenizer is not None:
            tokenizer.byte_level_tables  # noqa: B018 - built now (up to ~1 s for 128k tokens), not on a first token

    def add(self, req: Request, on_first_token: Callable[[Request], None] | None = None) -> None:
        """Give ``req`` an output text primed with the tokens it already has.

        With ``on_first_token`` the request is handed off after its next token (see
        :meth:`worker.engine.Engine.admit`).
        """
        decoder = self.tokenizer.incremental_decoder() if self.tokenizer else _NoText()
        text = OutputText(decoder, req.params.stop)
        for token in req.output_ids:
            text.append(token)
        self._texts[req.request_id] = text
        if on_first_token is not None:
            self._handoffs[req.request_id] = on_first_token

    def drop_handoff(self, request_id: str) -> None:
        """Forget ``request_id``'s hand-off callback (it is aborted: the callback must not run)."""
        self._handoffs.pop(request_id, None)

    def text(self, request_id: str) -> str:
        """The request's output text so far (stop strings cut off)."""
        return self._texts[request_id].text

    def forget(self, request_id: str) -> None:
        """Drop the output state of a finished request."""
        del self._texts[request_id]
        self._handoffs.pop(request_id, None)

    def append_token(self, req: Request, token: int, logprob: float | None) -> RequestEvent:
        """Append a sampled ``token`` to ``req``; finishes it when it ends here. Returns its event."""
        text = self._texts[req.request_id]
        return self._decide(req, token, logprob, *text.append(token), text)

    def append_tokens(self, sampled: list[tuple[Request, int, float | None]]) -> list[RequestEvent]:
        """:meth:`append_token` of each ``(request, token, logprob)`` of a step, in order, with the
        step's tokens detokenized together (one batch for all its requests)."""
        by_id = self._texts
        texts = [by_id[req.request_id] for req, _, _ in sampled]
        pieces = append_each(texts, [token for _, token, _ in sampled])
        decide = self._decide
        return [decide(req, token, lp, delta, stopped, text)
                for (req, token, lp), (delta, stopped), text in zip(sampled, pieces, texts)]

    def _decide(self, req: Request, token: int, logprob: float | None, delta: str, stopped: bool,
                text: OutputText) -> RequestEvent:
        """Record ``token`` (whose text ``delta`` is streamable; ``stopped``: a stop string matched) on
        ``req`` (whose output text is ``text``), decide whether it ends here, and return its event."""
        p = req.params
        req.prefilling = False
        req.output_ids.append(token)
        if logprob is not None and p.logprobs:
            req.logprobs.append(logprob)
        phases = None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            if len(req.output_ids) == 1 and req.scheduled_time is not None:  # its first token anywhere
                phases = (req.scheduled_time - req.arrival_time, req.first_token_time - req.scheduled_time)
        reason = stop_reason = None
        if stopped:
            reason, stop_reason = "stop", text.matched
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"  # the end of sequence: no stop_reason, as vLLM
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        # the first output token's event carries the prompt's log-probabilities, when asked for
        first = len(req.output_ids) == 1
        prompt = list(req.prompt_logprobs) if p.prompt_logprobs is not None and first else None
        cached = (req.cached_tokens or 0) if first else None
        handoff = self._handoffs.pop(req.request_id, None) if self._handoffs else None
        if reason is None and handoff is not None:
            handoff(req)  # the pages still hold the KV: the callback must take it before they are freed
            self.scheduler.finish(req, "handoff")
            return RequestEvent(req.request_id, [token], delta, True, "handoff", [logprob] if p.logprobs else None,
                                phases=phases, prompt_logprobs=prompt, cached_tokens=cached)
        if reason is not None:
            self.scheduler.finish(req, reason)
            req.stop_reason = stop_reason
            delta += text.flush()
        return RequestEvent(req.request_id, [token], delta, reason is not None, reason,
                            [logprob] if p.logprobs else None, phases=phases, stop_reason=stop_reason,
                            prompt_logprobs=prompt, cached_tokens=cached)

    def fail_all(self, reason: str) -> list[RequestEvent]:
        """End every running and waiting request with an error (``reason`` kept in :attr:`errors`)."""
        events = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "error")
            self.errors[req.request_id] = reason
            events.append(RequestEvent(req.request_id, [], self._texts[req.request_id].flush(), True, "error"))
        return events


class _NoText:
    """Stands in for a tokenizer's incremental decoder when the checkpoint has none."""

    def add(self, token_id: int) -> str:
        return ""
