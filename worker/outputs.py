"""What the engine hands out: per-step request events, finished outputs, and step statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    """What one engine step did (kept for metrics)."""

    phase: str
    batch_size: int
    num_tokens: int
    duration_s: float  # the whole step: build the message, execute, read the tokens back, events
    execute_s: float = 0.0  # waiting for the step's tokens: from its send (sync) or from the wait's start (async)
    rank_s: float = 0.0  # of which the rank's own Worker.execute (the rest is the hop to the rank)


@dataclass(frozen=True)
class RequestEvent:
    """Progress of one request in one step: new tokens, the text they completed, and finish."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    error: str | None = None  # why, when finish_reason is "error" (set by the fleet)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None
    num_preemptions: int
    error: str | None = None  # why, when finish_reason is "error" (set by the fleet)
