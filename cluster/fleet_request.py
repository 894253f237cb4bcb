"""One request as the fleet tracks it across groups (owned by the fleet's loop thread)."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from worker.engine import RequestEvent, RequestOutput
from worker.sampling.params import SamplingParams


@dataclass(eq=False)
class FleetRequest:
    """A request's fleet-wide state: what the client has been sent, and where the request is now.

    ``output_ids``/``logprobs``/``text`` are exactly what was delivered to the client, so a request
    moved to another group resumes from them (the group re-prefills prompt + output and samples
    output token ``len(output_ids)`` with the same seed). At most one of ``slot`` (a group's engine
    holds it) and ``payload`` (its KV waits for a decode group) is set; neither while it is queued.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    timeout_s: float | None
    sink: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    submitted: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    attempts: int = 0  # prefills started
    moves: int = 0  # times its KV was lost (group failure, failed hand-off) and it was requeued
    slot: object = None
    payload: object = None
    holds_admission: bool = True  # counts against the router's queue bound until first dispatched
    last_failure: str | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic delivery time of each event with tokens

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.submitted + self.timeout_s

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def remaining_output(self, max_model_len: int) -> int:
        return max(0, min(self.params.max_tokens - len(self.output_ids), max_model_len - self.num_tokens))

    def deliver(self, event: RequestEvent) -> None:
        """Record ``event`` as sent (with its time, if it carries tokens) and send it to the client."""
        if event.token_ids:
            self.token_times.append(time.monotonic())  # before the put: a reader of event k sees time k
        self.output_ids.extend(event.token_ids)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        self.text += event.text
        self.sink.put(event)

    def finish(self, reason: str, error: str | None = None, event: RequestEvent | None = None) -> RequestOutput:
        """Send the final event (``event``, or an empty one) and then the request's output."""
        if event is None:
            event = RequestEvent(self.request_id, [], "", True, reason, None, error)
        self.deliver(event)
        out = RequestOutput(self.request_id, list(self.prompt_ids), list(self.output_ids), self.text, reason,
                            list(self.logprobs) if self.params.logprobs else None, self.moves, error)
        self.sink.put(out)
        return out
