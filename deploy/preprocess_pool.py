"""The request preprocessing pool: :func:`deploy.preprocess.prepare` in processes of its own.

A :class:`Preprocessor` runs ``prepare`` in a pool of processes (``serve.preprocess_workers``),
each holding the checkpoint's tokenizer (the pool worker's one piece of state, set when it
starts), so the replica's event loop and fleet thread never hold the GIL for a large body's
parsing, templating or tokenizing. A body of at most ``serve.preprocess_inline_bytes`` (off by
default) is prepared on the replica's loop instead: its work is bounded by its size, and alone it
costs less than a pool round trip, though a burst of them is prepared one at a time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from typing import Any

from deploy.errors import ApiError
from deploy.preprocess import PreparedRequest, prepare
from deploy.shared_bodies import SHARED_BODY_BYTES, SharedBodies, SharedBody, read_body
from worker.admission import PromptLimits
from worker.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("ray.serve").getChild("graphfleet")

__all__ = ["MAX_BODIES_PER_CALL", "SHARED_BODY_BYTES", "Preprocessor"]


#: Most bodies one call to a pool worker prepares (see :class:`Preprocessor`).
MAX_BODIES_PER_CALL = 16
_worker_tokenizer: Tokenizer | None = None  # a pool worker's tokenizer, loaded once when it starts


def _start_worker(model_path: str, parent_pid: int) -> None:
    global _worker_tokenizer
    # A pool worker outlives a SIGKILLed replica (it holds its queue's write end too): end with it.
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="preprocess-parent-watch",
                     daemon=True).start()
    _worker_tokenizer = load_tokenizer(model_path)
    if _worker_tokenizer is not None:
        _ = _worker_tokenizer.max_bytes_per_token  # read the vocabulary once, before the first request


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _prepare_in_worker(route: str, raw: bytes | tuple[str, int], limits: PromptLimits) -> PreparedRequest | ApiError:
    if isinstance(raw, tuple):  # a large body, handed over in shared memory (see Preprocessor.prepare)
        raw = _read_shared(*raw)
    try:
        return prepare(route, raw, _worker_tokenizer, limits)
    except ApiError as e:
        return e


def _prepare_batch_in_worker(items: list[tuple[str, bytes, PromptLimits]]) -> list[Any]:
    """:func:`_prepare_in_worker` of each body; any other exception is that body's answer alone."""
    out: list[Any] = []
    for route, raw, limits in items:
        try:
            out.append(_prepare_in_worker(route, raw, limits))
        except Exception as e:  # noqa: BLE001 - raised again for its own request by the replica
            out.append(e)
    return out


def _read_shared(name: str, size: int) -> bytes:
    # Attaching registers the segment with the resource tracker, which a spawned worker shares with
    # the replica (a set of names: one entry); the replica unlinks it, and that unregisters it.
    shm = shared_memory.SharedMemory(name=name)
    try:
        return bytes(shm.buf[:size])
    finally:
        shm.close()


def _ready() -> bool:
    return True


class Preprocessor:
    """Runs :func:`prepare` in ``workers`` processes (spawned, each loading the tokenizer of checkpoint
    ``model_path`` once), so the replica's process spends on a request only the body's bytes.

    Bodies that arrive while every worker is busy wait on the replica's event loop and go to the
    next free worker together, at most :data:`MAX_BODIES_PER_CALL` in one call (what waits is shared
    across the free workers): one pool call costs the replica's executor threads and both processes
    a round trip whatever it carries: 64 bodies of 512 token ids sent at once took a median 82 ms
    through two workers one call each, 64 ms one body a call through this queue, 25 ms up to 16 a
    call, against 0.27-0.35 ms apiece to prepare (2-core CPU machine, 10 bursts each).
    A body's own failure is its answer alone. Bodies over :data:`SHARED_BODY_BYTES` go alone, in
    shared memory: :attr:`bodies` keeps one segment of ``max_body_bytes`` per worker for them
    (:mod:`deploy.shared_bodies`; read a body into one with :meth:`read`).

    A request whose worker dies (killed, out of memory) gets a 500 naming it, as does every body of
    that call; the pool is replaced, and later requests go on. :meth:`shutdown` ends the workers.
    """

    def __init__(self, model_path: str, workers: int, inline_bytes: int = 0,
                 tokenizer: Tokenizer | None = None, max_body_bytes: int = 16 * 1024 * 1024) -> None:
        self._model_path, self._workers = str(model_path), workers
        self._inline_bytes = inline_bytes
        self._tokenizer = tokenizer  # the replica's, for the bodies prepared inline
        self._pool = self._new_pool()
        self.bodies = SharedBodies(workers, max_body_bytes)
        # Event-loop state (touched only on the loop that runs prepare): bodies not yet handed to
        # a worker, and calls under way.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: collections.deque[tuple[str, bytes, PromptLimits, asyncio.Future]] = collections.deque()
        self._calls = 0

    def _new_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(self._model_path, os.getpid()))
        for _ in range(self._workers):  # start them now, not on the first requests
            pool.submit(_ready)
        return pool

    async def read(self, chunks) -> bytes | SharedBody:
        """A request's body from its ``chunks`` (``request.stream()``), a large one straight into
        shared memory: :func:`deploy.shared_bodies.read_body`. Hand the result to :meth:`prepare`."""
        return await read_body(chunks, self.bodies)

    async def prepare(self, route: str, raw: bytes | SharedBody, limits: PromptLimits) -> PreparedRequest:
        """:func:`prepare` of ``raw``, here if it is at most ``inline_bytes`` long, else in a worker;
        raises its :class:`ApiError`.

        A body over :data:`SHARED_BODY_BYTES` goes to the worker in shared memory: through the pool's
        pipe (64 KiB at a time, each piece a wake-up of both processes) a 10 MB body took 0.25-0.3 s
        on a 2-core machine, during which the streams of other requests stalled. Its segment is
        given back when the worker is done with it, even if this request is cancelled first.
        """
        if isinstance(raw, bytes) and len(raw) > SHARED_BODY_BYTES:
            raw = self.bodies.one_off(raw)
        if isinstance(raw, SharedBody):
            result = await self._shared(route, raw, limits)
        elif len(raw) <= self._inline_bytes:
            return prepare(route, raw, self._tokenizer, limits)
        else:
            result = await self._batched(route, raw, limits)
        if isinstance(result, BaseException):
            raise result
        return result

    async def _shared(self, route: str, body: SharedBody, limits: PromptLimits) -> Any:
        pool = self._pool
        try:
            submitted = pool.submit(_prepare_in_worker, route, (body.name, body.size), limits)
        except BrokenProcessPool:
            self.bodies.give_back(body)
            self._replace(pool)
            raise _died() from None
        except RuntimeError:  # the pool was shut down
            self.bodies.give_back(body)
            raise _shutting_down() from None
        # Given back from the pool's thread once the worker is done (or the call never ran): a
        # cancelled request must not free a segment a worker still reads.
        submitted.add_done_callback(lambda _: self.bodies.give_back(body))
        try:
            return await asyncio.wrap_future(submitted)
        except BrokenProcessPool:
            self._replace(pool)
            raise _died() from None

    async def _batched(self, route: str, raw: bytes, limits: PromptLimits) -> Any:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (a test's next asyncio.run): the old one's calls are gone
            self._loop, self._calls = loop, 0
            self._waiting.clear()
        answer = loop.create_future()
        self._waiting.append((route, raw, limits, answer))
        self._dispatch()
        return await answer

    def _dispatch(self) -> None:
        """Hand what waits to the free workers, shared out, at most MAX_BODIES_PER_CALL a call."""
        while self._waiting and self._calls < self._workers:
            n = min(MAX_BODIES_PER_CALL, -(-len(self._waiting) // (self._workers - self._calls)))
            batch = [self._waiting.popleft() for _ in range(n)]
            batch = [item for item in batch if not item[3].done()]  # their requests were cancelled
            if not batch:
                continue
            pool = self._pool
            try:
                submitted = pool.submit(_prepare_batch_in_worker, [item[:3] for item in batch])
            except BrokenProcessPool:  # a worker died since the last call: this batch is not lost
                self._replace(pool)
                self._waiting.extendleft(reversed(batch))
                continue
            except RuntimeError:  # the pool was shut down
                _settle(batch, [_shutting_down() for _ in batch])
                continue
            self._calls += 1
            call = asyncio.wrap_future(submitted)
            call.add_done_callback(lambda done, batch=batch, pool=pool: self._answer(done, batch, pool))

    def _answer(self, call: asyncio.Future, batch: list, pool: ProcessPoolExecutor) -> None:
        self._calls = max(0, self._calls - 1)
        if call.cancelled():
            results: list[Any] = [_shutting_down() for _ in batch]
        elif isinstance(call.exception(), BrokenProcessPool):
            self._replace(pool)
            results = [_died() for _ in batch]
        elif call.exception() is not None:  # the call itself failed (its answers did not pickle, ...)
            e = call.exception()
            results = [ApiError(500, f"internal error preparing the request: {type(e).__name__}: {e}",
                                "internal_error") for _ in batch]
        else:
            results = call.result()
        _settle(batch, results)
        self._dispatch()

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            log.error("a request preprocessing process died; starting a new pool")
            pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()

    def shutdown(self) -> None:
        """End the workers and remove the kept body segments."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.bodies.close()


def _settle(batch: list, results: list) -> None:
    """Each waiting request of ``batch`` gets its result (one cancelled meanwhile gets none)."""
    for (_, _, _, answer), result in zip(batch, results, strict=True):
        if not answer.done():
            answer.set_result(result)


def _died() -> ApiError:
    return ApiError(500, "internal error: the process preparing this request died (its body may be too "
                         "large to parse in memory); retry", "internal_error")


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "unavailable")
