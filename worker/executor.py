"""What the engine needs from whatever runs its steps, and how that can fail."""

from __future__ import annotations

from typing import Protocol

from worker.model.arch import ModelArch
from worker.step_message import StepMessage, StepResult


class ExecutorFailed(RuntimeError):
    """A step did not complete and the KV cache it relied on is gone (e.g. a rank died).

    The engine re-queues every running request for recomputation; the executor recovers (or
    reports :class:`ExecutorUnavailable`) on the next step.
    """


class ExecutorUnavailable(RuntimeError):
    """No step can run now or soon (a restart failed or timed out); requests end with an error."""


class PendingStep(Protocol):
    """A sent step; :meth:`result` waits for its tokens, raising :class:`ExecutorFailed` or
    :class:`ExecutorUnavailable` when the step is lost."""

    def result(self) -> StepResult: ...


class DeferredStep:
    """A step that runs when its result is asked for: a local worker's ``submit`` (nothing runs
    beside the engine, so the order of results is the order of execution)."""

    def __init__(self, run, msg: StepMessage) -> None:
        self._run, self._msg = run, msg
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._run(self._msg)
        return self._result


class Executor(Protocol):
    """Runs step messages on the model: a local ``Worker`` or a tensor-parallel group.

    The engine only submits: ``submit`` sends a step without waiting for it; steps run in the
    order they are submitted, and a step's ``from_previous`` inputs come from the step submitted
    just before it. ``num_pages`` and ``max_len`` size the engine's page allocator and requests.
    """

    arch: ModelArch
    num_pages: int
    max_len: int

    def submit(self, msg: StepMessage) -> PendingStep: ...

    def shutdown(self) -> None: ...
