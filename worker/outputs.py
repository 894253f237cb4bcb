"""What the engine hands out: per-step request events, finished outputs, and step statistics."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    """What one engine step did (kept for metrics)."""

    phase: str  # "prefill", "decode" or "mixed" (decode rows and prefill chunks: worker.scheduler)
    batch_size: int
    num_tokens: int
    duration_s: float  # the whole step: build the message, execute, read the tokens back, events
    execute_s: float = 0.0  # waiting for the step's tokens: from its send (sync) or from the wait's start (async)
    rank_s: float = 0.0  # of which the rank's own Worker.execute (the rest is the hop to the rank)
    wait_s: float = 0.0  # of which the rank waited for the device to finish (0 on a CPU)
    wait_cpu_s: float = 0.0  # the CPU the waiting thread spent in ``wait_s`` (spinning, waking)


class FailureKind(enum.Enum):
    """Why a request ended with finish_reason "error" (set with ``error`` by the fleet, which ends it).

    DEADLINE: not finished within its ``timeout_s``.
    GROUP_FAILED: its group failed and it could not go on: the group is lost (dead and not
        restarting), no group of a role it needs is left, or its group's executor is gone.
    REJECTED: a group's engine refused it (``RequestRejected``).
    GAVE_UP: its KV was lost ``cluster.max_attempts`` times (group failures, failed hand-offs).
    FLEET_STOPPED: the fleet shut down, or its loop crashed, before it finished.
    """

    DEADLINE = "deadline"
    GROUP_FAILED = "group_failed"
    REJECTED = "rejected"
    GAVE_UP = "gave_up"
    FLEET_STOPPED = "fleet_stopped"


@dataclass(slots=True)
class RequestEvent:
    """Progress of one request in one step: new tokens, the text they completed, and finish.

    Treat as immutable (derive with ``dataclasses.replace``). Not ``frozen``: a frozen dataclass
    sets each field through ``object.__setattr__``, 1.3 against 0.3 us per event, and a step makes
    one per request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    #: one entry per token when the request asked for log-probabilities: the token's log-probability,
    #: or with ``top_logprobs`` > 0 ``(logprob, ids, logprobs)``: its alternatives' token ids and
    #: log-probabilities, most likely first (:class:`worker.sampling.params.SamplingParams`), as
    #: int32 and float32 ``bytes`` here (:func:`worker.sampling.packed_rows.alternatives` spells
    #: them; a :class:`RequestOutput` holds them spelled)
    logprobs: list[float | tuple[float, bytes, bytes]] | None = None
    error: str | None = None  # why, when finish_reason is "error" (set by the fleet)
    failure: FailureKind | None = None  # the kind of that error (set by the fleet)
    #: on the event of a request's first output token: (seconds it waited in the engine's queue,
    #: seconds from its first step to that token), as vLLM's request_queue/prefill_time_seconds
    phases: tuple[float, float] | None = None
    #: on a finishing event: the stop string or stop token id that ended the request (vLLM's
    #: ``stop_reason``; None for the end-of-sequence token, a length limit or an error)
    stop_reason: str | int | None = None
    #: on the event of a request's first output token, when its params ask for prompt_logprobs: an
    #: entry ``(logprob, ids, logprobs)`` per prompt token after the first
    prompt_logprobs: list[tuple[float, list[int], list[float]]] | None = None
    #: on the event of a request's first output token: its prompt tokens found in the prefix cache
    #: (what the API reports as ``usage.prompt_tokens_details.cached_tokens``)
    cached_tokens: int | None = None


def events_to_wire(events: Sequence[RequestEvent]) -> tuple:
    """``events`` as columns of builtins (:func:`events_from_wire` inverts it): pickling them costs
    no Python-level reducer per event (6 against 134 us for 64 events under cloudpickle)."""
    return (tuple(e.request_id for e in events), tuple(e.token_ids for e in events), tuple(e.text for e in events),
            tuple(e.finished for e in events), tuple(e.finish_reason for e in events),
            tuple(e.logprobs for e in events), tuple(e.error for e in events),
            tuple(None if e.failure is None else e.failure.value for e in events), tuple(e.phases for e in events),
            tuple(e.stop_reason for e in events), tuple(e.prompt_logprobs for e in events),
            tuple(e.cached_tokens for e in events))


def events_from_wire(columns: tuple) -> list[RequestEvent]:
    """The events :func:`events_to_wire` packed."""
    ids, tokens, texts, finished, reasons, logprobs, errors, failures, phases, stops, prompts, cached = columns
    return [RequestEvent(i, t, x, f, r, lp, e, None if k is None else FailureKind(k), ph, sr, pl, c)
            for i, t, x, f, r, lp, e, k, ph, sr, pl, c in zip(ids, tokens, texts, finished, reasons, logprobs,
                                                              errors, failures, phases, stops, prompts, cached)]


def merge_events(events: Sequence[RequestEvent]) -> RequestEvent:
    """One event with the tokens, text and logprobs of consecutive ``events`` of one request, and
    the finish of the last."""
    if len(events) == 1:
        return events[0]
    # A copy of the first (its lists its own), extended by the rest; the constructor, not
    # ``dataclasses.replace``, which inspects the fields on every call.
    f = events[0]
    merged = RequestEvent(f.request_id, list(f.token_ids), f.text, f.finished, f.finish_reason,
                          None if f.logprobs is None else list(f.logprobs), f.error, f.failure, f.phases,
                          f.stop_reason, f.prompt_logprobs, f.cached_tokens)
    for e in events[1:]:
        extend_event(merged, e)
    return merged


def extend_event(into: RequestEvent, later: RequestEvent) -> None:
    """:func:`merge_events` of ``(into, later)`` written into ``into``, which must be the caller's own
    (a merge result no one else holds: events are otherwise treated as immutable)."""
    into.token_ids += later.token_ids
    into.text += later.text
    if later.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = list(later.logprobs)
        else:
            into.logprobs += later.logprobs
    into.finished, into.finish_reason, into.error, into.failure = (later.finished, later.finish_reason, later.error,
                                                                   later.failure)
    into.stop_reason = later.stop_reason
    if into.phases is None:
        into.phases = later.phases
    if into.prompt_logprobs is None:
        into.prompt_logprobs = later.prompt_logprobs
    if into.cached_tokens is None:
        into.cached_tokens = later.cached_tokens


@dataclass(frozen=True)
class RequestOutput:
    """A finished request: its prompt and output tokens, text and finish reason (with why, on an error)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float | tuple[float, list[int], list[float]]] | None  # as RequestEvent's, spelled as lists
    num_preemptions: int
    error: str | None = None  # why, when finish_reason is "error" (set by the fleet)
    failure: FailureKind | None = None  # the kind of that error (set by the fleet)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (RequestEvent's)
    prompt_logprobs: list[tuple[float, list[int], list[float]]] | None = None  # RequestEvent's, when asked for
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (RequestEvent's)
