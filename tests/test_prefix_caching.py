"""Automatic prefix caching in the engine (cache.prefix_caching): outputs equal the uncached engine's,
hits equal what the shared prefixes predict, pages and refcounts come back."""

from __future__ import annotations

import functools
import random

from prometheus_client import CollectorRegistry

from deploy.config import load_config
from tests.page_checks import assert_all_pages_back
from worker.engine import Engine
from worker.prefix_hash import page_keys
from worker.sampling.params import SamplingParams

PAGE = 16


def _engine(path, caching: bool, *overrides: str, registry=None) -> Engine:
    return Engine(load_config(None, [f"model.path={path}", "model.device=cpu", f"cache.page_size={PAGE}",
                                     f"cache.prefix_caching={str(caching).lower()}", *overrides]), registry=registry)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(n)]



def test_sequential_hits_equal_the_prediction_and_outputs_equal_uncached(checkpoint_dir):
    """One request at a time (synchronous steps): a page is cached once a step wrote it, so every
    request's hit is the longest run of its prompt's full pages (at most len - 1 tokens) among the pages
    of the requests before it: their prompts and their outputs but the last token (multi-turn follow-ups
    hit those)."""
    path = checkpoint_dir("tiny-llama")
    rng = random.Random(11)
    systems = [_tokens(rng, n) for n in (37, 48, 70, 16)]  # 48 and 16: a whole number of pages
    registry = CollectorRegistry()
    on = _engine(path, True, "scheduler.async_scheduling=false", "scheduler.chunked_prefill_size=64",
                 "graphs.prefill.max_tokens=64", registry=registry)
    off = _engine(path, False, "scheduler.async_scheduling=false", "scheduler.chunked_prefill_size=64",
                  "graphs.prefill.max_tokens=64")
    free = on.num_free_pages
    cached_keys: set[bytes] = set()
    history: list[list[int]] = []  # each request's prompt + output
    queries = hits = 0
    for i in range(40):
        if i % 7 == 6:  # a follow-up turn: an earlier conversation, then new tokens
            prompt = rng.choice(history) + _tokens(rng, rng.randint(1, 20))
        else:
            prompt = rng.choice(systems) + _tokens(rng, rng.choice([0, 1, 5, 16, 30]))
        params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, ignore_eos=True)
        keys = page_keys(prompt, PAGE, limit=(len(prompt) - 1) // PAGE)
        expect = next((j for j, k in enumerate(keys) if k not in cached_keys), len(keys)) * PAGE
        got = on.generate([prompt], params)[0]
        ref = off.generate([prompt], params)[0]
        assert got.token_ids == ref.token_ids, i
        assert (got.cached_tokens, ref.cached_tokens) == (expect, 0), i
        queries, hits = queries + len(prompt), hits + expect
        history.append(prompt + got.token_ids)
        cached_keys.update(page_keys(history[-1][:-1], PAGE))
    assert hits > 20 * PAGE  # the workload does share
    assert (on.prefix_cache_stats.queries, on.prefix_cache_stats.hits) == (queries, hits)
    assert registry.get_sample_value("prefix_cache_queries_total") == queries
    assert registry.get_sample_value("prefix_cache_hits_total") == hits
    assert off.prefix_cache_stats.queries == 0
    assert_all_pages_back(on, free)
    # Prefill steps computed only what was not cached.
    computed = sum(s.num_tokens for s in on.step_stats if s.phase == "prefill")
    assert computed == queries - hits == sum(s.num_tokens for s in off.step_stats if s.phase == "prefill") - hits


def test_concurrent_requests_with_preemption_and_aborts_equal_uncached(checkpoint_dir):
    """200 greedy requests over five shared system prompts, arriving while others run (async
    scheduling), prompts longer than a prefill chunk, a cache small enough to preempt and evict, and
    aborts: every request that is not aborted gets the uncached engine's tokens; every page and ref
    comes back."""
    path = checkpoint_dir("tiny-llama")
    rng = random.Random(5)
    systems = [_tokens(rng, n) for n in (20, 33, 47, 64, 90)]
    work = []
    for i in range(200):
        prompt = rng.choice(systems) + _tokens(rng, rng.randint(0, 60))
        params = SamplingParams(max_tokens=rng.randint(1, 32), temperature=0, ignore_eos=True)
        work.append((prompt, params, rng.randint(0, 3), rng.randint(1, 40) if i % 6 == 0 else None))
    overrides = ("cache.num_pages=24", "scheduler.max_running_requests=12", "scheduler.chunked_prefill_size=64",
                 "scheduler.max_num_batched_tokens=64", "graphs.prefill.max_tokens=64",
                 "graphs.decode.max_batch_size=16", "graphs.debug=true")
    results = {}
    for caching in (True, False):
        engine = _engine(path, caching, *overrides)
        free = engine.num_free_pages
        ids, aborts, steps, pending = [], {}, 0, list(work)
        while pending or engine.has_unfinished():
            burst = pending[0][2] if pending else 0
            for _ in range(burst + (not engine.has_unfinished())):
                if pending:
                    prompt, params, _, abort_after = pending.pop(0)
                    ids.append(engine.add_request(prompt, params))
                    if abort_after is not None:
                        aborts[ids[-1]] = steps + abort_after
            engine.step()
            steps += 1
            for rid, at in list(aborts.items()):
                if steps >= at:
                    engine.abort(rid)
                    del aborts[rid]
            assert steps < 20_000
        assert_all_pages_back(engine, free)
        results[caching] = (engine, [engine.output(i) for i in ids])
    (on, got), (off, ref) = results[True], results[False]
    kept = [k for k, (_, _, _, abort_after) in enumerate(work) if abort_after is None]
    assert [got[k].token_ids for k in kept] == [ref[k].token_ids for k in kept]
    assert all(got[k].finish_reason == "length" for k in kept)
    assert any(o.finish_reason == "abort" for o in got)
    assert on.scheduler.num_preemptions > 0 and off.scheduler.num_preemptions > 0
    stats = on.prefix_cache_stats
    assert stats.hits > 100 * PAGE and stats.queries >= sum(len(work[k][0]) for k in kept)
    assert sum(o.cached_tokens for o in got) <= stats.hits  # re-admissions after preemption hit too
    assert all(o.cached_tokens % PAGE == 0 and o.cached_tokens < len(o.prompt_token_ids) for o in got)
    assert on.allocator.num_cached > 0 and all(o.cached_tokens == 0 for o in ref)


def test_prompt_logprobs_compute_the_whole_prompt(checkpoint_dir):
    """Cached positions have no logits: a request asking for prompt log-probabilities reads nothing
    from the cache (its pages are cached for others all the same)."""
    path = checkpoint_dir("tiny-llama")
    engine = _engine(path, True)
    prompt = list(range(10, 60))
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    first, second = (engine.generate([prompt], scored)[0] for _ in range(2))
    assert first.cached_tokens == second.cached_tokens == 0 and second.prompt_logprobs == first.prompt_logprobs
    plain = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert plain.cached_tokens == 48 and plain.token_ids == first.token_ids


class _LosesOneStep:
    """The local worker as an executor, except that its ``lose``-th step never runs and is reported
    lost (``ExecutorFailed``), as when a rank dies: the KV that step was to write is never written."""

    def __init__(self, worker, lose: int) -> None:
        self.worker, self.lose, self.sent = worker, lose, 0
        self.arch, self.num_pages, self.max_len = worker.arch, worker.num_pages, worker.max_len

    def submit(self, msg):
        from worker.executor import ExecutorFailed

        self.sent += 1
        if self.sent != self.lose:
            return self.worker.submit(msg)

        class Lost:
            def result(self):
                raise ExecutorFailed("rank 0 died")
        return Lost()

    def shutdown(self) -> None:
        self.worker.shutdown()


def test_a_lost_step_empties_the_cache(checkpoint_dir):
    """A prefill step that is lost registered pages it never wrote: the cache is emptied, the request is
    recomputed, and a later request with the same prompt finds the recomputed pages, not the unwritten ones."""
    from worker.worker import Worker

    path = checkpoint_dir("tiny-llama")
    config = load_config(None, [f"model.path={path}", "model.device=cpu", f"cache.page_size={PAGE}",
                                "scheduler.async_scheduling=false"])
    prompt = list(range(10, 60))  # 3 full pages
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = _engine(path, False).generate([prompt], greedy)[0].token_ids
    engine = Engine(config, executor=_LosesOneStep(Worker.local(config), lose=1))
    free = engine.num_free_pages
    first = engine.add_request(prompt, greedy)
    assert engine.step() == [] and engine.allocator.num_cached == 0  # lost: re-queued, nothing cached
    assert engine.scheduler.num_preemptions == 1
    while engine.has_unfinished():
        engine.step()
    again = engine.generate([prompt], greedy)[0]
    assert engine.output(first).token_ids == want and again.token_ids == want
    assert engine.output(first).cached_tokens == 0 and again.cached_tokens == 48
    assert_all_pages_back(engine, free)


def test_hand_off_exports_shared_pages_and_drops_the_prefill_engines_refs(checkpoint_dir):
    """Disaggregated, in-process: the prefill engine (synchronous, as a fleet's prefill role) caches;
    each hand-off exports the request's pages, shared ones included, and its refs are dropped once it
    is handed off; the decode engine imports into fresh pages and continues token for token."""
    from worker.kv_pages import export_pages, import_pages

    path = checkpoint_dir("tiny-llama")
    rng = random.Random(2)
    system = _tokens(rng, 40)
    prompts = [system + _tokens(rng, n) for n in (3, 17, 30)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = _engine(path, False).generate(prompts, greedy)
    pre, dec = _engine(path, True, "scheduler.async_scheduling=false"), _engine(path, True)
    free = pre.num_free_pages
    payloads, shared = {}, {}

    def export(req):
        shared[req.request_id] = sum(pre.allocator.refcount(p) > 1 for p in req.pages)
        payloads[req.request_id] = (export_pages(pre.worker, req.pages), list(req.output_ids))

    handed = []
    for i, p in enumerate(prompts):  # one after another: the later ones find the system prompt cached
        pre.admit(p, greedy, seed=i, request_id=f"r{i}", on_first_token=export)
        if i == 0:
            handed += [ev for _ in range(3) for ev in pre.step()]
    handed += [ev for _ in range(5) for ev in pre.step()]
    assert [ev.finish_reason for ev in handed] == ["handoff"] * 3
    assert [ev.cached_tokens for ev in handed] == [0, 32, 32]
    # r1 and r2 were prefilled together, sharing r0's two cached pages: r1 left first.
    assert shared == {"r0": 0, "r1": 2, "r2": 0}
    assert_all_pages_back(pre, free)
    assert pre.allocator.num_cached > 0
    for i, p in enumerate(prompts):
        payload, out = payloads[f"r{i}"]
        dec.add_prefilled_request(p, out, greedy, seed=i, request_id=f"r{i}",
                                  import_kv=functools.partial(import_pages, dec.worker, payload=payload))
    while dec.has_unfinished():
        dec.step()
    assert [dec.output(f"r{i}").token_ids for i in range(3)] == [o.token_ids for o in want]


def test_async_pages_are_shared_once_sent_and_held_when_dropped_in_flight(checkpoint_dir):
    """Async scheduling: a page is cached as soon as the step writing it is sent (a step reading it runs
    after), and a cached page whose last ref is dropped while a step is in flight is held (not free,
    still found) until that step is read back."""
    path = checkpoint_dir("tiny-llama")
    rng = random.Random(9)
    system = _tokens(rng, 40)
    prompts = [system + _tokens(rng, 10), system + _tokens(rng, 20)]  # 50 tokens: 3 full pages; 60
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = _engine(path, False).generate([prompts[1], prompts[0]], greedy)
    engine = _engine(path, True, "graphs.debug=true")
    free = engine.num_free_pages
    a = engine.add_request(prompts[0], greedy)
    engine.step()  # a's prefill is sent, not read back: its three full pages are cached already
    assert engine.in_flight and engine.allocator.num_cached == 3
    b = engine.add_request(prompts[1], greedy)
    engine.step()  # b's prefill, on a's first two pages, is sent; a's prefill is read back
    assert engine.requests[b].cached_tokens == 32 and engine.in_flight
    a_pages = list(engine.requests[a].pages)
    engine.abort(a)
    pool = engine.allocator
    assert [pool.refcount(p) for p in a_pages] == [1, 1, 0, 0]  # b still holds the shared two
    assert pool.num_evictable == 0 and engine.num_free_pages == free - len(engine.requests[b].pages) - 2
    c = engine.add_request(prompts[0], greedy)  # a again: its held third page is still found
    while engine.has_unfinished():
        engine.step()
    assert engine.output(c).cached_tokens == 48
    assert [engine.output(r).token_ids for r in (b, c)] == [o.token_ids for o in want]
    assert_all_pages_back(engine, free)
