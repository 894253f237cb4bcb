"""What the engine needs from whatever runs its steps, and how that can fail."""

from __future__ import annotations

from typing import Protocol

from worker.model.arch import ModelArch
from worker.step import StepMessage, StepResult


class ExecutorFailed(RuntimeError):
    """A step did not complete and the KV cache it relied on is gone (e.g. a rank died).

    The engine re-queues every running request for recomputation; the executor recovers (or
    reports :class:`ExecutorUnavailable`) on the next step.
    """


class ExecutorUnavailable(RuntimeError):
    """No step can run now or soon (a restart failed or timed out); requests end with an error."""


class Executor(Protocol):
    """Runs step messages on the model: a local ``Worker`` or a tensor-parallel group."""

    arch: ModelArch
    num_pages: int
    max_len: int

    def execute(self, msg: StepMessage) -> StepResult: ...

    def shutdown(self) -> None: ...
