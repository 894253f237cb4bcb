"""A group's engine loop, run in the process of its leader rank (rank 0).

The engine (scheduler, step pipeline, sampling read-back, detokenization) lives beside the
leader's worker, so a step costs no round trip between the fleet and the ranks: the leader hands
each step to its followers (:mod:`cluster.step_channel`) and runs it itself. The fleet talks to the
engine only through two queues:

- *commands in*: numbered batches (:class:`cluster.group_messages.Admit`, ``Prefilled``, ``Abort``,
  ``Replan``)
  put by a Ray call on a thread of their own, applied by the loop in number order between steps;
- *reports out*: what the loop did since the last take (:class:`cluster.group_messages.GroupReport`),
  taken by the report link's thread (:mod:`cluster.report_link`) and sent to the fleet; one report
  carries every step done since the previous one, so the fleet never sees more than one message
  per step.

One thread (the loop) owns the engine. A thread waiting for work or for a report sleeps on a
condition; nothing polls. An exception from a step ends the loop: the group is dead, and the
fleet, which watches the loop's Ray call, fails it and moves its requests.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from cluster.group_messages import (
    Abort,
    Admit,
    EngineLoad,
    GroupReport,
    Prefilled,
    Refused,
    Replan,
    Replanned,
    Staged,
)
from cluster.report_buffer import ReportBuffer, load_is_stale
from cluster.step_channel import IMPORT, STAGE, LeaderExecutor
from cluster.threads import name_os_thread
from worker.engine import Engine
from worker.outputs import FailureKind, RequestEvent
from worker.request import Request, RequestRejected
from worker.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

#: Threads that fetch hand-offs' KV shards at once (each fetch waits on the object store or a peer).
RESOLVE_THREADS = 4
#: Steps of a phase since its last plan below which its padding is not judged (too few to be a trend).
AUTO_REPLAN_MIN_STEPS = 32


class EngineHost:
    """The engine loop of one generation of a group, on its leader.

    ``stage(transfer_id, pages)`` copies pages on this rank for a hand-off; ``resolve(transport,
    shards, timeout_s)`` turns a :class:`Prefilled` request's shards into one item per rank (and
    starts the senders, for point-to-point transports); ``import_shard(pages, transport, item)``
    writes this rank's item into pages.
    """

    def __init__(self, config, executor: LeaderExecutor, role: str, max_model_len: int,
                 stage: Callable[[str, list[int]], None], resolve: Callable, import_shard: Callable) -> None:
        self.role, self.executor = role, executor
        # Shards that must be fetched (ray.get) are resolved off the loop: a fetch of a request's KV
        # would stall every other request's decode for as long as it takes.
        self._resolver = ThreadPoolExecutor(max_workers=RESOLVE_THREADS, thread_name_prefix="kv-resolve")
        self._resolving: dict[str, tuple[Prefilled, Future]] = {}  # engine id -> (command, its shards), FIFO
        self._resolved = False  # a resolution finished since the loop last looked
        # The engine's metrics (prefix_cache_*) join the leader's registry, labelled as its rank's.
        leader = getattr(executor, "worker", None)
        self.engine = Engine(config, executor=executor, tokenizer=load_tokenizer(config.model.path),
                             registry=getattr(leader, "registry", None),
                             metric_labels=getattr(leader, "metric_labels", None))
        self.engine.cap_max_model_len(max_model_len)
        self._stage, self._resolve, self._import_shard = stage, resolve, import_shard
        self._cond = threading.Condition()
        self._inbox: dict[int, list] = {}  # batch number -> commands (applied in number order)
        self._applied = 0
        self._report = ReportBuffer()
        self._new = False  # the report has something a poll should not wait for
        self._stopping = False
        self._step_started: float | None = None
        self._pending = GroupReport()  # what the loop did since its last publish (the loop's own)
        self._error: str | None = None
        self.running = False  #: whether :meth:`run` is on (shutdown waits for it to end)
        graphs = config.graphs
        self._auto_base = graphs.replan_interval_s
        self._auto_interval = self._auto_base  # doubled by each automatic re-plan, reset by a look without drift
        self._auto_share = graphs.replan_padding_share
        self._auto_next = time.monotonic() + (self._auto_interval or 0.0)
        self._auto_count = 0

    # ----- called by the fleet (other threads) -----

    def put(self, number: int, commands: list) -> None:
        """Queue command batch ``number`` (batches are applied in number order, from 1)."""
        with self._cond:
            self._inbox[number] = commands
            self._cond.notify_all()

    def take_report(self, wait_s: float) -> GroupReport:
        """What happened since the last call; waits up to ``wait_s`` for something to happen."""
        end = time.monotonic() + wait_s
        with self._cond:
            while not self._new and not self._stopping and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
            report, self._new = self._report.take(), False
            report.step_s = time.monotonic() - self._step_started if self._step_started is not None else 0.0
            report.loop_error = self._error
            return report

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (a report taken after it is the last)."""
        return self._stopping

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._resolver.shutdown(wait=False, cancel_futures=True)

    # ----- the loop -----

    def run(self) -> None:
        """Apply commands and step until :meth:`stop`; a failed step raises (the group is dead)."""
        self.running = True
        name_os_thread("engine-loop")
        try:
            self._publish([])
            while True:
                with self._cond:
                    while not self._stopping and self._applied + 1 not in self._inbox \
                            and not self.engine.has_unfinished() and not self._resolved:
                        self._cond.wait(1.0)
                    if self._stopping:
                        return
                    batches = []
                    while self._applied + 1 in self._inbox:
                        self._applied += 1
                        batches.append(self._inbox.pop(self._applied))
                    resolved, self._resolved = self._resolved, False
                for commands in batches:
                    for command in commands:
                        self._apply(command)
                if resolved:
                    self._admit_resolved()
                if self.engine.has_unfinished():
                    with self._cond:
                        self._step_started = time.monotonic()
                    events = self.engine.step()
                    with self._cond:
                        self._step_started = None
                    self._publish(events)
                    if self._auto_interval is not None and time.monotonic() >= self._auto_next:
                        self._auto_replan()
                else:
                    self._publish([])
        except BaseException as e:
            with self._cond:
                self._error = f"{type(e).__name__}: {e}"
                self._new = True
                self._cond.notify_all()
            raise
        finally:
            self.running = False

    def _apply(self, command) -> None:
        if isinstance(command, Admit):
            self._admit(command)
        elif isinstance(command, Prefilled):
            self._admit_prefilled(command)
        elif isinstance(command, Replan):
            self._replan(command)
        elif isinstance(command, Abort):
            if self._resolving.pop(command.engine_id, None) is not None:
                return  # its KV had not arrived: nothing was admitted, nothing to release
            if self.engine.abort(command.engine_id):
                self.engine.release(command.engine_id)
        else:
            raise TypeError(f"unknown command {type(command).__name__}")

    def _replan(self, c: Replan) -> None:
        outcome = self.engine.replan()
        summary = outcome.summary.to_dict() if outcome.summary is not None else None
        if summary is not None:
            log.info("group re-planned its graphs in %.2f s: %s", summary["seconds"], summary["line"])
        else:
            log.warning("graph re-plan refused: %s", outcome.error)
        self._pending.replans.append(Replanned(c.replan_id, summary, outcome.error))
        self._publish(outcome.events)

    def _auto_replan(self) -> None:
        """``graphs.replan_interval_s``: re-plan when a phase's graphs padded more than
        ``graphs.replan_padding_share`` of what they replayed since the last plan."""
        drift = {phase: (share, steps) for phase, (share, steps) in self.executor.padding_since_plan().items()
                 if steps >= AUTO_REPLAN_MIN_STEPS and share > self._auto_share}
        if not drift:
            self._auto_interval = self._auto_base
        else:
            self._auto_count += 1
            log.info("automatic graph re-plan: padding since the last plan %s (over %.0f%%)",
                     ", ".join(f"{p} {share:.0%} of {steps} steps" for p, (share, steps) in drift.items()),
                     100 * self._auto_share)
            self._replan(Replan(f"auto-{self._auto_count}"))
            self._auto_interval *= 2  # a drift the budget cannot plan away is not re-planned every look
        self._auto_next = time.monotonic() + self._auto_interval

    def _admit(self, c: Admit) -> None:
        on_first_token = self._stage_for_hand_off if c.hand_off else None
        try:
            self.engine.admit(c.prompt_ids, c.params, seed=c.seed, request_id=c.engine_id, output_ids=c.output_ids,
                              logprobs=c.logprobs, on_first_token=on_first_token,
                              expected_cached_tokens=c.expected_cached_tokens)
        except RequestRejected as e:
            # The fleet checked the prompt against the same limits: only a broken invariant lands here.
            self._pending.events.append(RequestEvent(c.engine_id, [], "", True, "error", None,
                                                     f"rejected by the group: {e}", FailureKind.REJECTED))

    def _admit_prefilled(self, c: Prefilled) -> None:
        """Check room, then resolve ``c``'s shards: at once for a point-to-point transport (it only
        orders the sends), else on a resolver thread, the request joining the engine once they are
        here (:meth:`_admit_resolved`) while the loop goes on stepping."""
        full = self._no_room(c)
        if full is not None:
            self._refuse(Refused(c.engine_id, "no_room", full))
            return
        if c.transport == "nccl":
            try:
                items = self._resolve(c.transport, c.shards, c.timeout_s)
            except Exception as err:  # noqa: BLE001 - nothing was written: the fleet re-prefills it
                self._refuse_unresolved(c, err)
                return
            self._import(c, items)
            return
        try:
            future = self._resolver.submit(self._resolve, c.transport, c.shards, c.timeout_s)
        except RuntimeError:  # stop() shut the resolver down
            self._refuse(Refused(c.engine_id, "transfer_failed", "the group is shutting down"))
            return
        self._resolving[c.engine_id] = (c, future)
        future.add_done_callback(self._on_resolved)

    def _on_resolved(self, _future: Future) -> None:
        with self._cond:
            self._resolved = True
            self._cond.notify_all()

    def _admit_resolved(self) -> None:
        """Import every request whose shards have arrived (or refuse it), in arrival order."""
        done = [(eid, c, f) for eid, (c, f) in self._resolving.items() if f.done()]
        for eid, c, future in done:
            del self._resolving[eid]
            try:
                items = future.result()
            except Exception as err:  # noqa: BLE001 - nothing was written: the fleet re-prefills it
                self._refuse_unresolved(c, err)
                continue
            self._import(c, items)

    def _no_room(self, c: Prefilled) -> str | None:
        """Why ``c`` cannot be admitted now, counting the pages and slots of the requests whose
        shards are still being resolved (they are admitted before it)."""
        pages = sum(self._kv_pages(r) for r, _ in self._resolving.values())
        return self.engine.no_room_for_prefilled(_kv_tokens(c), reserved_pages=pages,
                                                 reserved_requests=len(self._resolving))

    def _kv_pages(self, c: Prefilled) -> int:
        """Pages ``c``'s imported KV takes here."""
        return -(-_kv_tokens(c) // self.engine.config.cache.page_size)

    def _refuse_unresolved(self, c: Prefilled, err: Exception) -> None:
        self._refuse(Refused(c.engine_id, "transfer_failed", f"KV for the import did not arrive: "
                                                             f"{type(err).__name__}: {err}"))

    def _import(self, c: Prefilled, items: list) -> None:
        """Admit ``c`` into the engine, every rank writing its shard into the pages it gets."""
        ordered: list[bool] = []  # whether the followers were told to import (their state is then unknown)

        def import_kv(pages: list[int]) -> None:
            channel = self.executor.channel
            if channel is not None:
                channel.send((IMPORT, list(pages), c.transport))
                ordered.append(True)
                mine = channel.scatter(items)
            else:
                mine = items[0]
            self._import_shard(list(pages), c.transport, mine)

        try:
            self.engine.add_prefilled_request(c.prompt_ids, c.output_ids, c.params, seed=c.seed,
                                              request_id=c.engine_id, logprobs=c.logprobs, import_kv=import_kv)
        except RequestRejected as err:
            self._refuse(Refused(c.engine_id, "rejected", str(err)))
            return
        except Exception as err:  # noqa: BLE001 - any failure of the transfer: the fleet re-prefills it
            timed_out = "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower()
            self._refuse(Refused(c.engine_id, "transfer_failed",
                                 f"KV import into this group failed: {type(err).__name__}: {err}",
                                 fail_group=bool(ordered) or timed_out))
            return
        self._pending.accepted.append(c.engine_id)

    def _refuse(self, refused: Refused) -> None:
        self._pending.refused.append(refused)

    def _stage_for_hand_off(self, req: Request) -> None:
        # Runs inside the engine's step, before the request's pages are freed; must not raise.
        # Followers stage on receiving the order, which they run before any later step's.
        pages, num_tokens = list(req.pages), req.num_computed
        transfer_id = uuid.uuid4().hex
        try:
            channel = self.executor.channel
            if channel is not None:
                channel.send((STAGE, transfer_id, pages))
            self._stage(transfer_id, pages)
            self._pending.staged[req.request_id] = Staged(transfer_id, len(pages), num_tokens)
        except Exception as e:  # noqa: BLE001 - reported: the fleet re-prefills the request
            self._pending.staged[req.request_id] = Staged(None, len(pages), num_tokens,
                                                          f"KV export failed: {type(e).__name__}: {e}")

    def _publish(self, events: list[RequestEvent]) -> None:
        e = self.engine
        ended = False
        for i, ev in enumerate(events):
            if ev.finished or ev.finish_reason == "handoff":
                if ev.finish_reason == "error" and ev.error is None:
                    events[i] = dataclasses.replace(ev, error=e.errors.get(ev.request_id),
                                                    failure=FailureKind.GROUP_FAILED)
                e.release(ev.request_id)
                ended = True
        p = self._pending
        p.events.extend(events)
        self._pending = GroupReport()
        # Taken outside the lock (it walks every request); the report thread may swap the report
        # meanwhile, so a new report without a load takes the last one, still paired with `applied`.
        previous = self._report.report
        stale = load_is_stale(previous, p, self._applied, ended)
        load = self._load() if stale else previous.load
        with self._cond:
            buffer = self._report
            buffer.add(p)
            changed = buffer.report.load != load
            if stale or buffer.report.load is None:
                buffer.set_load(load, self._applied)  # the load as of these batches, never of later ones
            if p.events or p.staged or p.accepted or p.refused or p.replans or changed:
                self._new = True
                self._cond.notify_all()

    def _load(self) -> EngineLoad:
        e = self.engine
        s = e.scheduler
        # One pass, no property calls: this runs after every step, over every request.
        max_len, decoding = e.max_model_len, self.role != "prefill"
        prefill = decode = 0
        for queue in (s.running, s.waiting):
            for r in queue:
                made = len(r.output_ids)
                tokens = len(r.prompt_ids) + made
                if r.prefilling:
                    if r.num_computed or not r.expected_cached_tokens:
                        prefill += tokens - r.num_computed
                    else:  # not admitted yet: what the router counted for it (Router.prefill_work)
                        prefill += max(1, tokens - r.expected_cached_tokens)
                if decoding:
                    left = min(r.params.max_tokens - made, max_len - tokens)
                    if left > 0:
                        decode += left
        requests = len(s.running) + len(s.waiting)
        free, waiting = e.num_free_pages, len(self._resolving)
        for c, _ in self._resolving.values():  # hand-offs whose KV is on its way hold their pages and slots already
            free -= self._kv_pages(c)
            decode += max(0, min(c.params.max_tokens - len(c.output_ids), e.max_model_len - _kv_tokens(c) - 1))
        return EngineLoad(max(0, free), e.allocator.num_usable, requests + waiting, prefill + decode)



def _kv_tokens(c: Prefilled) -> int:
    """Tokens of ``c`` whose KV it brings: all but the last, which its first decode step writes."""
    return len(c.prompt_ids) + len(c.output_ids) - 1
