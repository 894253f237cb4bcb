"""In-batch prefix deduplication (scheduler.defer_shared_prefixes, worker/scheduler.py): prompts that
share a prefix not yet cached and arrive together compute it once; a request skipped for a step keeps
its place and is never held back by a sharer that is aborted or preempted; every page comes back."""

from __future__ import annotations

import random

import pytest

from deploy.config import load_config
from tests.page_checks import assert_all_pages_back
from worker.engine import Engine
from worker.prefix_cache import PrefixCachePool
from worker.request import Request, Status
from worker.sampling.params import SamplingParams
from worker.scheduler import ScheduledBatch, Scheduler, SchedulerLimits

PAGE = 16
PREFIX = list(range(100, 164))  # 4 full pages


# ----- the scheduler alone (no model) -----

def _scheduler(budget: int, defer: bool = True, mixed: bool = True, pages: int = 64) -> Scheduler:
    return Scheduler(SchedulerLimits(64, budget, budget, PAGE, mixed, None, defer), PrefixCachePool(pages))


def _request(tokens: list[int], arrival: int, max_tokens: int = 3) -> Request:
    return Request(f"r{arrival}", tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                   arrival=arrival)


def _send(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the synchronous step pipeline does with a step: send it (pages registered), read it back."""
    for req, n in zip(batch.requests, batch.num_new):
        req.num_computed += n
    sched.cache_full_pages(batch.requests)
    for req, sample in zip(batch.requests, batch.sample):
        if sample:
            req.output_ids.append(7)
            req.prefilling = False
            if len(req.output_ids) >= req.params.max_tokens:
                sched.finish(req, "length")


def _run_out(sched: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None and steps < limit, f"stalled: waiting {[r.request_id for r in sched.waiting]}"
        _send(sched, batch)
        steps += 1
    pool = sched.allocator
    assert pool.num_free == pool.num_usable and all(pool.refcount(p) == 0 for p in range(pool.num_pages))
    return steps


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "prefill-only"])
def test_a_request_whose_next_page_an_earlier_admission_computes_waits_one_step_in_its_place(mixed):
    full = _request(PREFIX + list(range(1, 9)), 0)
    partial = _request(PREFIX[:48] + list(range(900, 920)), 1)  # shares three of the four pages
    other = _request(list(range(500, 540)), 2)  # shares nothing: not held back
    again = _request(PREFIX + list(range(2000, 2009)), 3)
    sched = _scheduler(budget=256, mixed=mixed)
    for r in (full, partial, other, again):
        sched.add(r)
    first = sched.schedule()
    assert first.requests == [full, other] and list(sched.waiting) == [partial, again]
    _send(sched, first)
    second = sched.schedule()
    prefill = slice(second.num_decode_rows, None)
    assert second.requests[prefill] == [partial, again] and second.start[prefill] == [48, 64]
    assert (sched.cache_stats.hits, partial.cached_tokens, again.cached_tokens) == (112, 48, 64)
    _run_out(sched)
    # Policy off: all four are admitted together and compute the prefix three times.
    off = _scheduler(budget=256, defer=False, mixed=mixed)
    reqs = [_request(r.prompt_ids, r.arrival) for r in (full, partial, other, again)]
    for r in reqs:
        off.add(r)
    assert off.schedule().requests == reqs and off.cache_stats.hits == 0


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_a_sharer_gone_mid_prefix_holds_no_one_back(how):
    """The first sharer's prompt spans two chunks of 48 tokens; after its first chunk it is aborted, or
    every running request is preempted (as after a lost step: the cache is emptied too). Aborted: the
    next sharer goes on from the three pages cached, and the one after it waits a step for the page
    that one computes. Preempted: it starts again in front of the others, which wait for its last chunk
    and then hit all four pages. Everyone finishes."""
    reqs = [_request(PREFIX + list(range(10 * i, 10 * i + 8 + i)), i) for i in range(3)]
    sched = _scheduler(budget=48)
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    assert first.requests == [reqs[0]] and first.num_new == [48]
    _send(sched, first)
    if how == "abort":
        sched.finish(reqs[0], "abort")
        rest = reqs[1:]
    else:
        assert sched.preempt_all() == 1  # it goes back to the front, the cache is emptied
        rest = reqs
        again = sched.schedule()
        assert again.requests == [reqs[0]] and again.start == [0]
        _send(sched, again)
    second = sched.schedule()
    assert second.requests == [rest[0]] and second.start == [48]  # page 3 is now claimed by it
    assert list(sched.waiting) == rest[1:]
    _send(sched, second)
    third = sched.schedule()
    skipped = slice(third.num_decode_rows, None)
    assert third.requests[skipped] == rest[1:] and set(third.start[skipped]) == {64}  # all four pages hit
    _run_out(sched)
    assert all(r.status is Status.FINISHED and r.finish_reason == "length" for r in rest)
    assert [r.cached_tokens for r in rest] == ([48, 64] if how == "abort" else [0, 64, 64])


def test_random_sharers_with_aborts_and_preemption_all_finish():
    """Random arrivals over a few shared prefixes on a pool small enough to preempt and evict, with
    aborts: every request not aborted finishes within a bounded number of steps; every page comes back."""
    rng = random.Random(4)
    prefixes = [[rng.randrange(1000) for _ in range(PAGE * rng.randint(1, 5))] for _ in range(4)]
    for mixed in (True, False):
        sched = _scheduler(budget=64, mixed=mixed, pages=24)
        pending = [_request(rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 40))], i,
                            max_tokens=rng.randint(1, 40)) for i in range(300)]
        live, steps = [], 0
        while pending or sched.has_work():
            for _ in range(rng.randint(0, 3)):
                if pending:
                    live.append(pending.pop(0))
                    sched.add(live[-1])
            if live and rng.random() < 0.03:
                sched.finish(rng.choice(live), "abort")
            batch = sched.schedule()
            if batch is not None:
                _send(sched, batch)
            steps += 1
            assert steps < 20_000
        _run_out(sched)
        assert sched.num_preemptions > 0 and sched.cache_stats.hits > 50 * PAGE
        assert all(r.finish_reason in ("length", "abort") for r in live)


# ----- the engine -----

def _engine(path, *overrides: str, caching: bool = True) -> Engine:
    return Engine(load_config(None, [f"model.path={path}", "model.device=cpu", f"cache.page_size={PAGE}",
                                     "graphs.debug=true", f"cache.prefix_caching={str(caching).lower()}", *overrides]))



def _sharers(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 1024) for _ in range(4 * PAGE)]
    return [system + [rng.randrange(3, 1024) for _ in range(rng.randint(1, 20))] for _ in range(n)]


@pytest.mark.parametrize("shape", [(), ("scheduler.mixed_steps=false", "scheduler.async_scheduling=false")],
                         ids=["mixed-async", "prefill-only-sync"])
def test_a_burst_sharing_a_prefix_computes_it_once(checkpoint_dir, shape):
    """Eight requests sharing a 4-page prefix, added together: with the policy the prefix is computed
    once (the other seven hit it), the tokens equal the policy's off and prefix caching's off."""
    path = checkpoint_dir("tiny-llama")
    prompts, n, max_tokens = _sharers(8, seed=3), 8, 5
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engines = {"on": _engine(path, *shape), "off": _engine(path, *shape, "scheduler.defer_shared_prefixes=false"),
               "uncached": _engine(path, *shape, caching=False)}
    free = {k: e.num_free_pages for k, e in engines.items()}
    outs = {k: e.generate(prompts, greedy) for k, e in engines.items()}
    assert [o.token_ids for o in outs["on"]] == [o.token_ids for o in outs["off"]] == \
        [o.token_ids for o in outs["uncached"]]
    prefix, prompt_tokens = 4 * PAGE, sum(map(len, prompts))
    assert [o.cached_tokens for o in outs["on"]] == [0] + [prefix] * (n - 1)
    assert engines["on"].prefix_cache_stats.hits == (n - 1) * prefix
    assert engines["off"].prefix_cache_stats.hits == 0  # all eight in the first step: each computed it
    decode_rows = n * (max_tokens - 1)  # every token after the first is one decode row
    computed = {k: sum(s.num_tokens for s in e.step_stats) - decode_rows for k, e in engines.items()}
    assert computed == {"on": prompt_tokens - (n - 1) * prefix, "off": prompt_tokens, "uncached": prompt_tokens}
    assert engines["on"].step_stats[0].num_tokens == len(prompts[0])  # the first step: the first request alone
    for k, e in engines.items():
        assert_all_pages_back(e, free[k])


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_first_sharer_aborted_mid_prefix_holds_no_one_back(checkpoint_dir, async_scheduling):
    path = checkpoint_dir("tiny-llama")
    prompts = _sharers(6, seed=5)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    shape = ("scheduler.chunked_prefill_size=48", "graphs.prefill.max_tokens=48",
             f"scheduler.async_scheduling={str(async_scheduling).lower()}")
    want = _engine(path, *shape, caching=False).generate(prompts[1:], greedy)
    engine = _engine(path, *shape)
    free = engine.num_free_pages
    ids = [engine.add_request(p, greedy) for p in prompts]
    engine.step()  # the first sharer's first 48 tokens (3 pages) are sent; the rest wait for budget
    assert engine.requests[ids[0]].num_computed == 48
    engine.abort(ids[0])
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 200
    got = [engine.output(i) for i in ids[1:]]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.cached_tokens for o in got] == [48] + [64] * 4
    assert_all_pages_back(engine, free)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_first_sharer_preempted_mid_prefix_holds_no_one_back(checkpoint_dir, async_scheduling):
    """Two older requests decode on a cache of 7 pages; six sharers arrive. The first sharer is preempted
    before its prompt is done (the older requests grow); it comes back, and every sharer finishes with
    the uncached engine's tokens."""
    path = checkpoint_dir("tiny-llama")
    rng = random.Random(3)
    older = [[rng.randrange(3, 1024) for _ in range(n)] for n in (14, 30)]
    prompts = _sharers(6, seed=3)
    shape = ("cache.num_pages=8", "scheduler.chunked_prefill_size=32", "scheduler.max_num_batched_tokens=32",
             "graphs.prefill.max_tokens=32",
             f"scheduler.async_scheduling={str(async_scheduling).lower()}")
    long, short = (SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in (40, 4))
    reference = _engine(path, *shape, caching=False)
    want = reference.generate(older, long) + reference.generate(prompts, short)
    engine = _engine(path, *shape)
    free = engine.num_free_pages
    ids = [engine.add_request(p, long) for p in older]
    engine.step()
    ids += [engine.add_request(p, short) for p in prompts]
    first, preempted_mid_prefix, steps = engine.requests[ids[2]], False, 0
    while engine.has_unfinished():
        engine.step()
        preempted_mid_prefix |= first.num_preemptions > 0 and not first.output_ids
        steps += 1
        assert steps < 2000
    assert preempted_mid_prefix
    assert [engine.output(i).token_ids for i in ids] == [o.token_ids for o in want]
    assert [engine.output(i).cached_tokens for i in ids[3:]] == [4 * PAGE] * 5
    assert_all_pages_back(engine, free)
