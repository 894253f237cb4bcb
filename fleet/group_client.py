"""The fleet's side of one group's engine: command batches out, report polls in.

A :class:`GroupClient` belongs to the fleet's loop thread, except its receiver thread, which
only makes Ray calls and hands what it gets to the loop (``post``). Per group:

- the loop buffers commands (:meth:`GroupClient.send`) and sends them as one numbered batch per
  loop iteration (:meth:`GroupClient.flush`): one Ray call, never one per request or token;
- the receiver reads the leader's report link (:mod:`cluster.report_link`) while a watcher thread
  waits on every rank's generation-long call beside it, so a report, a rank's death or a stuck step
  reaches the loop as one message: ``("report", (client, generation, report))`` or
  ``("failed", (client, generation, reason))``;
- the router weighs the engine's last reported load, adjusted by what was sent since
  (:meth:`GroupClient.load`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ray.exceptions import GetTimeoutError, RayError

from cluster.generation import failure_reason
from cluster.group_messages import EngineLoad, GroupReport
from cluster.report_link import HEARTBEAT_S, LinkClosed, ReportReader

log = logging.getLogger(__name__)


class GroupClient:
    """Commands to, and reports from, the engine on ``group``'s leader (see the module docstring)."""

    def __init__(self, group, post: Callable[[tuple], None]) -> None:
        self.group, self._post = group, post
        self.generation = group.generation  #: the generation the loop's commands go to
        self._number = 0
        self._buffer: list = []
        self._unapplied: list[tuple[int, int, int, int]] = []  # (batch, pages, tokens, requests) not yet in a report
        self._load: EngineLoad | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name=f"reports-{group.group_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    # ----- the loop's side -----

    def reset(self) -> None:
        """The group has a new generation (a new engine): nothing sent before counts any more."""
        self.generation = self.group.generation
        self._number, self._buffer, self._unapplied, self._load = 0, [], [], None

    def send(self, command, pages: int = 0, tokens: int = 0, requests: int = 0) -> None:
        """Buffer ``command``; the router counts ``pages``, ``tokens`` and ``requests`` against the
        group until a report shows the engine has applied it."""
        self._buffer.append(command)
        if pages or tokens or requests:
            self._unapplied.append((self._number + 1, pages, tokens, requests))

    def flush(self) -> None:
        """Send the buffered commands as one batch (no-op when there are none)."""
        if not self._buffer:
            return
        gen = self.group.current()
        batch, self._buffer = self._buffer, []
        if gen is None or gen.generation != self.generation:
            return  # the generation is gone: its requests are moved by the loop
        self._number += 1
        gen.leader.engine_commands.remote(self._number, batch)

    def update(self, report: GroupReport) -> None:
        if report.load is not None:
            self._load = report.load
        self._unapplied = [u for u in self._unapplied if u[0] > report.applied]

    def load(self) -> tuple[int, int, int, int]:
        """(free pages, usable pages, requests, outstanding tokens) as the router should see them now."""
        if self._load is None:
            free = usable = self.group.num_pages
            requests = tokens = 0
        else:
            free, usable = self._load.free_pages, self._load.num_usable
            requests, tokens = self._load.requests, self._load.outstanding_tokens
        for _, pages, t, r in self._unapplied:
            free, tokens, requests = free - pages, tokens + t, requests + r
        return free, usable, requests, tokens

    # ----- the receiver thread -----

    def _receive(self) -> None:
        timeout_s = self.group.config.cluster.step_timeout_s
        while not self._closed.is_set():
            gen = self.group.current()
            if gen is None or gen.engine_loop is None or gen.report_address is None:
                self._closed.wait(0.05)
                continue
            try:
                reason = self._follow(gen, timeout_s)
            except Exception as e:  # noqa: BLE001 - a receiver must never die silently
                reason = f"reports from the leader failed: {type(e).__name__}: {e}"
            if reason is None or self._closed.is_set():
                continue
            self._post(("failed", (self, gen.generation, reason)))
            while not self._closed.is_set() and self.group.current() is gen:
                self._closed.wait(0.05)  # the loop fails the generation; wait for it to go

    def _follow(self, gen, timeout_s: float) -> str | None:
        """Read ``gen``'s reports until it fails (returns why) or stops being current (None).

        A watcher thread waits on the ranks' generation-long calls beside the link, so a rank's
        death is seen at once, not when a step would have timed out; it ends the link to wake the
        read.
        """
        try:
            reader = ReportReader(gen.report_address)
        except OSError as e:
            return self._loops_reason(gen) or f"could not open the leader's report link: {type(e).__name__}: {e}"
        watch = _LoopWatch(gen, reader, self._closed)
        watch.start()
        try:
            while not self._closed.is_set() and self.group.current() is gen:
                try:
                    report: GroupReport = reader.read(HEARTBEAT_S + timeout_s)
                except TimeoutError:
                    return f"step exceeded cluster.step_timeout_s={timeout_s:g}s (the leader did not answer)"
                except LinkClosed as e:
                    if self._closed.is_set() or self.group.current() is not gen:
                        return None
                    return watch.wait_reason(_LINK_GRACE_S) or self._loops_reason(gen) \
                        or f"the leader's report link broke: {e}"
                self._post(("report", (self, gen.generation, report)))
                if report.loop_error is not None:
                    return f"a rank failed the step: {report.loop_error}"
                if report.step_s > timeout_s:
                    return f"step exceeded cluster.step_timeout_s={timeout_s:g}s"
            return None
        finally:
            watch.stop()
            reader.close()

    @staticmethod
    def _loops_reason(gen) -> str | None:
        """Why ``gen`` failed if one of its ranks' calls has ended (within a short grace), else None."""
        try:
            gen.watch_loops(_LINK_GRACE_S)
        except GetTimeoutError:
            return None
        except RayError as e:
            return failure_reason(gen, e)
        return None


#: How long a broken link waits for Ray to say which rank ended (a dead leader's call fails a moment
#: after its socket closes).
_LINK_GRACE_S = 5.0


class _LoopWatch:
    """Waits on ``gen``'s generation-long rank calls (their ``ray.wait`` wakes once per
    :data:`HEARTBEAT_S` to see whether it should stop); when one ends, records why and closes the
    link so the reader wakes."""

    def __init__(self, gen, reader: ReportReader, closed: threading.Event) -> None:
        self._gen, self._reader, self._closed = gen, reader, closed
        self._stop = threading.Event()
        self._done = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"loops-{gen.group_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def wait_reason(self, timeout_s: float) -> str | None:
        """The reason once the watch has one (waits up to ``timeout_s``), or None."""
        self._done.wait(timeout_s)
        return self.reason

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._closed.is_set():
                try:
                    self._gen.watch_loops(HEARTBEAT_S)
                except GetTimeoutError:
                    continue
                except RayError as e:
                    if not self._stop.is_set():
                        self.reason = failure_reason(self._gen, e)
                        self._reader.close()
                return
        except Exception as e:  # noqa: BLE001 - a watcher must never die silently
            self.reason = f"watching the ranks failed: {type(e).__name__}: {e}"
            self._reader.close()
        finally:
            self._done.set()
