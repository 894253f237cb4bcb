"""A launched step's sampled tokens, from the device to the host: pinned slots, their events, the wait.

:meth:`TokenReadback.copy` queues the copy of a step's tokens (log-probabilities and alternatives
when asked for) into the next pinned slot and records the slot's two events behind it;
:meth:`TokenReadback.wait` waits for them. A step whose log-probabilities were replayed from a
graph has them packed with its tokens (``SampleOutput.packed``): one copy, not four.
Slots are reused round-robin: a slot comes back after three copies, by which time its step has been
read (at most two steps are launched and unread).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from worker.sampling.packed_rows import PACKED_COLUMNS, row_bytes, unpack_lists
from worker.sampling.params import MAX_TOP_LOGPROBS

#: How much earlier than a step is expected to finish its read-back stops sleeping and starts spinning.
_SLEEP_MARGIN_S = 0.0002


@dataclass
class HostCopy:
    """A queued copy: the pinned host views it fills (``packed`` instead of the four before it when
    the step packed its rows), the events recorded behind it (one to spin on, one to sleep on), the
    step's shape (its expected duration is kept per shape) and when its launch began."""

    token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    prompt: tuple | None  # pinned host copies of SampleOutput.prompt, or None
    spinning: torch.cuda.Event
    sleeping: torch.cuda.Event
    key: tuple
    launched: float
    packed: torch.Tensor | None = None


class TokenReadback:
    """The pinned slots of one worker and, per step shape, how long a step takes from launch to done."""

    def __init__(self) -> None:
        self._slots: list[tuple] = []
        self._next = 0
        self._expected: dict[tuple, float] = {}  # step shape -> launch-to-done seconds, running average

    def copy(self, out, key: tuple, launched: float) -> HostCopy:
        """Queue the copy of ``out`` (a :class:`worker.sampling.sampler.SampleOutput`) into the next slot."""
        n = out.token_ids.shape[0]
        if not self._slots or self._slots[0][0].shape[0] < n:
            cap = max(n, 2 * self._slots[0][0].shape[0] if self._slots else 1024)
            self._slots = [(torch.empty(cap, dtype=torch.int64, pin_memory=True),
                            torch.empty(cap, dtype=torch.float32, pin_memory=True),
                            torch.empty(cap, MAX_TOP_LOGPROBS, dtype=torch.int64, pin_memory=True),
                            torch.empty(cap, MAX_TOP_LOGPROBS, dtype=torch.float32, pin_memory=True),
                            torch.cuda.Event(), torch.cuda.Event(blocking=True),
                            torch.empty(cap * PACKED_COLUMNS, dtype=torch.int32, pin_memory=True)) for _ in range(3)]
        tokens, logprobs, top_ids, top_logprobs, spinning, sleeping, packed = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        prompt = self._copy_prompt(out.prompt)
        columns = 0 if out.packed is None else out.packed.shape[1]
        if 0 < columns <= PACKED_COLUMNS:  # contiguous rows: one plain copy
            host = HostCopy(None, None, None, None, prompt, spinning, sleeping, key, launched,
                            packed[: n * columns].view(n, columns))
            host.packed.copy_(out.packed, non_blocking=True)
        else:
            tokens[:n].copy_(out.token_ids, non_blocking=True)
            if out.logprobs is not None:
                logprobs[:n].copy_(out.logprobs, non_blocking=True)
            tops = out.top_ids is not None
            if tops:
                width = out.top_ids.shape[1]
                top_ids, top_logprobs = top_ids[:n, :width], top_logprobs[:n, :width]
                top_ids.copy_(out.top_ids, non_blocking=True)
                top_logprobs.copy_(out.top_logprobs, non_blocking=True)
            host = HostCopy(tokens[:n], logprobs[:n] if out.logprobs is not None else None,
                            top_ids if tops else None, top_logprobs if tops else None, prompt, spinning, sleeping,
                            key, launched)
        spinning.record()
        sleeping.record()
        return host

    @staticmethod
    def _copy_prompt(prompt: tuple | None) -> tuple | None:
        """Pinned host copies of ``SampleOutput.prompt`` (rare: echo, evaluations), queued."""
        if prompt is None:
            return None
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in prompt)
        for h, dev in zip(host, prompt):
            h.copy_(dev, non_blocking=True)
        return host

    def wait(self, copy: HostCopy, newest: bool) -> tuple[list[int], list[float] | None, tuple | None, tuple | None,
                                                          float, float]:
        """The copied tokens, log-probabilities, alternatives (``(ids, logprobs)``, lists of rows) and
        prompt log-probabilities (:func:`prompt_lists`), the seconds waited and the thread's CPU
        seconds in the wait.

        For the newest launch (nothing queued behind it: the device idles once it is done) the thread
        first sleeps for most of what the same shape of step has taken from its launch to its end,
        then waits the rest on the spinning event, without the GIL: an engine loop waiting on its
        step leaves the interpreter to its process, and the step pays no wake-up latency (a blocking
        CUDA event cost 0.2 ms a step on the H200: bench/results/readback_ab-20261202T1033.json). An
        older launch (async scheduling: the next step is queued behind it, so the device stays busy
        while the thread wakes) waits on the blocking event and spends no CPU on the wait.

        Only the newest launch learns its duration (:func:`next_expected`): an older one was launched
        before this thread's own work since, so its launch-to-done time counts that work and any nap,
        and learning from it lengthens every later nap (a loop that only slows down).
        """
        begin, cpu = time.perf_counter(), time.thread_time()
        overslept = False
        if newest:
            expected = self._expected.get(copy.key)
            nap = copy.launched + (expected or 0.0) - _SLEEP_MARGIN_S - begin
            if nap > 0:
                time.sleep(nap)
                overslept = copy.spinning.query()  # done before the nap ended: when, it cannot tell
            copy.spinning.synchronize()
        else:
            copy.sleeping.synchronize()
        end, cpu_end = time.perf_counter(), time.thread_time()  # the wait's CPU, not the lists' below
        if newest:
            self._expected[copy.key] = next_expected(expected, end - copy.launched, overslept)
        tokens, logprobs, tops = sample_lists(copy)
        return tokens, logprobs, tops, prompt_lists(copy.prompt), end - begin, cpu_end - cpu


def sample_lists(out) -> tuple[list[int], list[float] | None, tuple[list[bytes], list[bytes]] | None]:
    """(token ids, log-probabilities or None, ``(ids rows, log-probability rows)`` or None) of a
    :class:`worker.sampling.sampler.SampleOutput` or :class:`HostCopy`: from its packed rows when it
    has them, else from its tensors (host ones; a device tensor is read here, a host sync).

    The alternatives' rows are ``bytes`` either way (:mod:`worker.sampling.packed_rows`: building
    64 x 20 Python ids and log-probabilities a step costs far more than slicing a row's bytes)."""
    if out.packed is not None:
        return unpack_lists(_numpy(out.packed))
    logprobs = _numpy(out.logprobs).tolist() if out.logprobs is not None else None
    tops = None if out.top_ids is None else (row_bytes(_numpy(out.top_ids).astype(np.int32)),
                                             row_bytes(_numpy(out.top_logprobs)))
    return _numpy(out.token_ids).tolist(), logprobs, tops


def _numpy(t: torch.Tensor):
    return t.numpy() if t.is_cpu else t.cpu().numpy()  # a device tensor: read (and waited for) here


def prompt_lists(prompt: tuple | None) -> tuple[list[float], list[list[int]], list[list[float]]] | None:
    """``SampleOutput.prompt`` (on the host or a CPU device) as lists: (logprobs, ids rows, logprobs rows)."""
    return None if prompt is None else tuple(t.tolist() for t in prompt)


def next_expected(expected: float | None, took: float, overslept: bool) -> float:
    """A shape's expected launch-to-done seconds after a newest launch that ``took`` seconds.

    When the step was already done as the nap ended (``overslept``), ``took`` is the nap (its
    oversleep included), not the step: learning it would let each oversleep lengthen the next nap,
    a drift without bound on a busy host (a sleep overshooting by more than the margin). Such a
    wait shortens the expectation by a fifth of the margin instead, until a nap ends before its step
    and the step's own end is measured again.
    """
    if expected is None:
        return took
    if overslept:
        return expected - 0.2 * _SLEEP_MARGIN_S
    return 0.8 * expected + 0.2 * took
