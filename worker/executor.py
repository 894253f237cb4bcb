"""What the engine needs from whatever runs its steps, and how that can fail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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


@dataclass
class LaunchedStep:
    """A step whose device work a worker has queued (:meth:`worker.worker.Worker.launch`).

    out: the sampled tokens on the device (None when no row samples); host: their copy to the host
    (a :class:`worker.readback.HostCopy`; None on a CPU, or on a rank that reads nothing back);
    logits: a float32 device copy of the step's logits when asked for; launch_s: how long the launch
    took; number: the worker's launch count at this launch (the newest launch has the current count).
    """

    out: Any
    host: Any
    logits: Any
    launch_s: float
    number: int


class PendingLaunch:
    """A local worker's ``submit``: the step is launched at once (steps queue on the device in
    submission order) and :meth:`result` waits for its tokens (once; later calls return the same)."""

    def __init__(self, worker, msg: StepMessage) -> None:
        self._worker = worker
        self._launched = worker.launch(msg)
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            self._result = self._worker.finish(self._launched)
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
