"""Continuous batching with chunked prefill over a paged KV cache.

How a step is composed (``SchedulerLimits.mixed_steps``):

- Mixed steps on (the default; vLLM's chunked prefill, SGLang's mixed chunk): while requests
  decode and prefill work waits (new requests, the next chunk of a long prompt, recomputation
  after preemption), a step carries every decode row first (one token each, growing pages and
  preempting exactly as a decode step does), then prefill chunks filling the rest of the token
  budget ``min(max_num_batched_tokens, chunked_prefill_size)`` (at most ``mixed_prefill_tokens``
  when set), in the order a prefill step takes them. Such a step is prefill-shaped (the prefill
  runner's token buckets and request slots); its decode rows are one-token requests.
  **Bound**: a running request that is not preempted gets a token from every step, and a step
  computes at most the budget's tokens (its decode rows plus ``mixed_prefill_tokens`` when set),
  so a running stream's inter-token gap is one step of that size at most, however many prompts
  arrive. When the decode rows alone fill the budget the step is a decode batch. A step whose
  decode rows preempted admits no waiting request (vLLM's rule): the pages a preemption frees
  go to the decode rows, not back to the request just preempted or to a newcomer that the next
  decode step would preempt in turn; running requests' prefill chunks still go in.
- Mixed steps off: a step is a prefill batch or a decode batch, prefill first (SGLang's default
  policy: it admits requests and bounds time to first token); a running stream waits one whole
  prefill step per chunk while prompts arrive.

Either way a step with nothing to prefill is a decode batch (the decode runner's batch-size
buckets, the full decode graph), and one with nothing to decode is a prefill batch.

Page accounting invariants: a page is written by at most one request (with prefix caching, full
cached pages are shared read-only, one ref per request: :mod:`worker.prefix_cache`); pages (refs)
are returned on finish, abort, hand-off and preemption; a waiting request is admitted only when
its chunk's pages are free; a running request that cannot grow preempts the youngest running
request.

Prefix caching (``prefix_cache`` given): when a waiting request is admitted (first, or again after a
preemption) it takes the longest run of cached full pages its sequence starts with, at most
``num_tokens - 1`` tokens (the last token is computed to sample), and prefills only the rest, from a
fresh page on. :meth:`Scheduler.cache_full_pages` registers each page once it is full of tokens
whose KV a sent step writes (prompt pages and decoded ones alike). A request asking for
``prompt_logprobs`` computes its whole prompt (cached positions have no logits).

In-batch prefix deduplication (``SchedulerLimits.defer_shared_prefixes``, with prefix caching): a
step's chunks *claim* the full pages they write (running requests' chunks and admissions alike).
A waiting request whose first full page it would compute (the first past its cached run, short of
its last token's page) is claimed by an earlier chunk of the same step is skipped for this step,
keeping its place in the waiting queue: the claiming chunk's pages are registered when the step is
sent, so the next step finds them cached (SGLang's in-batch prefix caching check). Shared prompts
arriving together compute their prefix once. **No starvation**: only a page that a chunk of this very
step writes defers, so every deferral comes with progress on the shared pages; once they are cached,
or nothing in the step writes them (the claimant finished, was aborted or preempted), the request is
admitted in its place. At most ``max_running_requests`` requests are skipped per step (the scan
stops there).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from worker.kv_cache import PageAllocator
from worker.page_table import PageTable
from worker.prefix_cache import PrefixCachePool
from worker.prefix_hash import page_keys
from worker.request import Request, Status


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler's part of ``worker.config.SchedulerConfig`` (and the KV page size)."""

    max_running_requests: int
    max_num_batched_tokens: int
    chunked_prefill_size: int
    page_size: int
    mixed_steps: bool = False
    mixed_prefill_tokens: int | None = None
    defer_shared_prefixes: bool = True

    def mixed_prefill_budget(self, num_decode_rows: int) -> int:
        """Prompt tokens a step carrying ``num_decode_rows`` decode rows may add (<= 0: none)."""
        left = min(self.max_num_batched_tokens, self.chunked_prefill_size) - num_decode_rows
        return left if self.mixed_prefill_tokens is None else min(left, self.mixed_prefill_tokens)


@dataclass
class ScheduledBatch:
    """One step's work: per request, ``num_new[i]`` tokens starting at ``start[i]``.

    A mixed step is a prefill batch whose first ``num_decode_rows`` rows are decode rows (one
    token each, sampled), followed by prefill chunks.
    """

    is_prefill: bool
    requests: list[Request]
    start: list[int]
    num_new: list[int]
    sample: list[bool]
    num_decode_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def is_mixed(self) -> bool:
        return self.num_decode_rows > 0

    @property
    def phase(self) -> str:
        """``mixed``, ``prefill`` or ``decode``: what the step is counted as."""
        return "mixed" if self.is_mixed else "prefill" if self.is_prefill else "decode"


@dataclass
class PrefixCacheStats:
    """Tokens looked up in the prefix cache at admissions (``queries``) and found there (``hits``)."""

    queries: int = 0
    hits: int = 0


_by_arrival = attrgetter("arrival")


class Scheduler:
    """Owns the waiting and running queues and the page allocator's bookings."""

    def __init__(self, limits: SchedulerLimits, allocator: PageAllocator | PrefixCachePool,
                 max_model_len: int = 1 << 62) -> None:
        """Prefix caching is on when ``allocator`` is a :class:`PrefixCachePool` (one pool owns every page)."""
        self.limits = limits
        self.allocator = allocator
        self.prefix_cache = allocator if isinstance(allocator, PrefixCachePool) else None
        self.cache_stats = PrefixCacheStats()
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request that already holds pages with its KV (all tokens but the last): it decodes next."""
        request.status = Status.RUNNING
        self.running.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch (see the module docstring), or None when nothing can run."""
        if self.limits.mixed_steps:
            return self._schedule_mixed()
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_mixed(self) -> ScheduledBatch | None:
        """Every decode row, then prefill chunks in the budget they leave (module docstring)."""
        preemptions = self.num_preemptions
        decode = self._schedule_decode()
        if decode is None:
            return self._schedule_prefill()
        budget = self.limits.mixed_prefill_budget(decode.size)
        admit = self.num_preemptions == preemptions  # a step that preempted admits nobody (module docstring)
        prefill = self._schedule_prefill(budget, admit) if budget > 0 else None
        if prefill is None:
            return decode
        return ScheduledBatch(True, decode.requests + prefill.requests, decode.start + prefill.start,
                              decode.num_new + prefill.num_new, decode.sample + prefill.sample,
                              num_decode_rows=decode.size)

    def _book(self, request: Request, total_tokens: int) -> bool:
        need = request.pages_needed(total_tokens, self.limits.page_size)
        if need == 0:  # most decode steps: the last page has room
            return True
        if not self.allocator.can_allocate(need):
            return False
        request.pages.extend(self.allocator.allocate(need))
        return True

    def _schedule_prefill(self, budget: int | None = None, admit: bool = True) -> ScheduledBatch | None:
        """Prefill chunks of running requests, then (if ``admit``) admissions, within ``budget`` tokens
        (default: min(max_num_batched_tokens, chunked_prefill_size))."""
        if budget is None:
            budget = min(self.limits.max_num_batched_tokens, self.limits.chunked_prefill_size)
        batch = ScheduledBatch(True, [], [], [], [])
        # The keys of the full pages this step's chunks write (in-batch deduplication: module docstring).
        dedup = self.prefix_cache is not None and self.limits.defer_shared_prefixes
        claimed: set[bytes] | None = set() if dedup else None

        def take(req: Request) -> bool:
            nonlocal budget
            remaining = req.num_tokens - req.num_computed
            n = min(remaining, budget)
            if n <= 0 or not self._book(req, req.num_computed + n):
                return False
            batch.requests.append(req)
            batch.start.append(req.num_computed)
            batch.num_new.append(n)
            batch.sample.append(n == remaining)
            budget -= n
            if claimed is not None:
                self._claim(claimed, req, req.num_computed, n)
            return True

        for req in self.running:
            if req.prefilling and budget > 0:
                take(req)
        skipped: list[Request] = []
        while admit and self.waiting and budget > 0 and len(self.running) < self.limits.max_running_requests:
            req = self.waiting[0]
            reused = self._reuse_cached_prefix(req)
            if claimed and self._computes_claimed(req, reused, claimed):
                self._put_back_cached_prefix(req, reused)
                skipped.append(self.waiting.popleft())
                if len(skipped) >= self.limits.max_running_requests:
                    break  # bounds the scan: each skip looked the request's prefix up
                continue
            # Headroom: leave one free page per running request so admission does not
            # immediately force the next decode step to preempt.
            headroom = len(self.running)
            need = req.pages_needed(req.num_computed + min(budget, req.num_tokens - req.num_computed),
                                    self.limits.page_size)
            if self.allocator.num_free - need < headroom or not take(req):
                self._put_back_cached_prefix(req, reused)
                break
            self._count_admission(req, reused)
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
        self.waiting.extendleft(reversed(skipped))  # back in front, in their order
        return batch if batch.requests else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        max_len = self.max_model_len
        decoding = [r for r in self.running
                    if not r.prefilling and not (r.num_pending and r.ends_with_pending(max_len))]
        if not decoding:
            return None
        scheduled: list[tuple[Request, int]] = []
        page_size = self.limits.page_size
        for req in sorted(decoding, key=_by_arrival):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            seq_len = req.seq_len  # preempting others does not change it
            if len(req.pages) * page_size >= seq_len:  # most decode steps: the last page has room
                scheduled.append((req, seq_len))
                continue
            while not self._book(req, seq_len):
                victim = max(self.running, key=_by_arrival)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                scheduled.append((req, seq_len))
        kept = [r for r, _ in scheduled if r.status is Status.RUNNING]
        if not kept:
            return None
        n = len(kept)
        starts = [seq_len - 1 for r, seq_len in scheduled if r.status is Status.RUNNING]
        return ScheduledBatch(False, kept, starts, [1] * n, [True] * n)

    # ----- prefix caching (allocation and admission) -----

    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """The keys of ``req``'s first ``num_pages`` full pages (``req.page_keys`` grown as needed)."""
        keys, size = req.page_keys, self.limits.page_size
        if len(keys) < num_pages:
            keys.extend(page_keys(req.tokens(len(keys) * size, num_pages * size), size,
                                  parent=keys[-1] if keys else None))
        return keys[:num_pages]

    def _reuse_cached_prefix(self, req: Request) -> int:
        """Give a waiting ``req`` without KV the cached pages its sequence starts with (one ref each) and
        skip their tokens; returns how many pages."""
        if self.prefix_cache is None or req.num_computed or req.pages or req.params.prompt_logprobs is not None:
            return 0
        pages = self.prefix_cache.acquire(self._keys(req, self._reusable_pages(req)))
        if pages:
            req.pages = PageTable(pages)
            req.num_cached_pages = len(pages)
            req.num_computed = len(pages) * self.limits.page_size
        return len(pages)

    def _claim(self, claimed: set[bytes], req: Request, start: int, n: int) -> None:
        """Add to ``claimed`` the keys of ``req``'s full pages that its chunk ``[start, start + n)`` writes."""
        size = self.limits.page_size
        end = min(-(-(start + n) // size), req.num_tokens // size)
        if end > start // size:
            claimed.update(self._keys(req, end)[start // size:])

    def _computes_claimed(self, req: Request, reused: int, claimed: set[bytes]) -> bool:
        """Whether the first full page ``req`` would compute after its ``reused`` cached ones (short of
        its last token's page) is in ``claimed``. Keys chain, so a page shared later means this one is."""
        if req.params.prompt_logprobs is not None:
            return False  # it reads nothing from the cache: waiting would not spare it any work
        keys = req.page_keys  # as far as _reuse_cached_prefix hashed them
        return reused < min(len(keys), self._reusable_pages(req)) and keys[reused] in claimed

    def _reusable_pages(self, req: Request) -> int:
        """Full pages before ``req``'s last token: the most it can take from the cache (the last token is
        computed, to sample)."""
        return (req.num_tokens - 1) // self.limits.page_size

    def _put_back_cached_prefix(self, req: Request, reused: int) -> None:
        """Undo :meth:`_reuse_cached_prefix` for a request that stays waiting."""
        if reused:
            self.prefix_cache.put_back(req.pages)
            req.pages = PageTable()
            req.num_computed = req.num_cached_pages = 0

    def _count_admission(self, req: Request, reused: int) -> None:
        hits = reused * self.limits.page_size
        if self.prefix_cache is not None and req.params.prompt_logprobs is None:
            self.cache_stats.queries += req.num_tokens
            self.cache_stats.hits += hits
        if req.cached_tokens is None:
            req.cached_tokens = hits

    def cache_full_pages(self, requests: list[Request]) -> None:
        """Register the pages of ``requests`` (just sent in a step) that are now full of tokens whose KV
        is written: up to ``num_computed`` tokens, and only tokens already known (a decode input still
        in flight is registered by the request's next step)."""
        cache = self.prefix_cache
        if cache is None:
            return
        size = self.limits.page_size
        for req in requests:  # runs every step: the common case (no page filled) costs one compare
            full = req.num_computed // size
            if full <= req.num_cached_pages:
                continue
            full = min(full, req.num_tokens // size)
            if full <= req.num_cached_pages or req.status is not Status.RUNNING:
                continue
            keys, pages = self._keys(req, full), req.pages
            for i in range(req.num_cached_pages, full):
                cache.register(pages[i], keys[i])
            req.num_cached_pages = full

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s pages and send it back to the front of the waiting queue."""
        self.allocator.free(req.pages)
        req.pages = PageTable()
        req.num_cached_pages = 0
        req.num_computed = 0
        req.num_pending = 0  # what steps in flight sample for it is dropped (its preemption count moved on)
        req.prefilling = True
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def preempt_all(self) -> int:
        """Send every running request back to waiting (their KV is lost, and so is every cached
        prefix: a lost step may have registered pages it never wrote); returns how many."""
        victims = sorted(self.running, key=lambda r: r.arrival, reverse=True)
        for req in victims:  # youngest first, so the oldest ends at the front of the queue
            self._preempt(req)
        if self.prefix_cache is not None:
            self.prefix_cache.forget_cached()
        return len(victims)

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished with ``reason`` and return its pages (idempotent)."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.allocator.free(req.pages)
        req.pages = PageTable()
        req.num_cached_pages = 0
        req.status = Status.FINISHED
        req.finish_reason = reason
