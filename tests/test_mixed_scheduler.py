"""Mixed steps in the scheduler alone (no model): what a step carries, chunk order, preemption,
decode-only and prefill-only steps, and the bound on a running request's wait."""

from __future__ import annotations

import random

from worker.kv_cache import PageAllocator
from worker.request import Request, Status
from worker.sampling.params import SamplingParams
from worker.scheduler import ScheduledBatch, Scheduler, SchedulerLimits

PAGE = 16


def make_scheduler(num_pages: int = 512, budget: int = 256, mixed: bool = True, running: int = 64,
                   mixed_prefill_tokens: int | None = None) -> Scheduler:
    limits = SchedulerLimits(running, budget, budget, PAGE, mixed, mixed_prefill_tokens)
    return Scheduler(limits, PageAllocator(num_pages))


def make_request(n: int, arrival: int, max_tokens: int = 1000) -> Request:
    return Request(f"r{arrival}", list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   seed=arrival, arrival=arrival)


def land(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the synchronous step pipeline does once a step's tokens are read back."""
    for req, n, sample in zip(batch.requests, batch.num_new, batch.sample):
        req.num_computed += n
        if sample:
            req.output_ids.append(7)
            req.prefilling = False
            if len(req.output_ids) >= req.params.max_tokens:
                sched.finish(req, "length")


def decoding(sched: Scheduler, *prompt_lens: int) -> list[Request]:
    """Requests admitted and prefilled together in one prefill step, now decoding."""
    reqs = [make_request(n, i) for i, n in enumerate(prompt_lens)]
    for req in reqs:
        sched.add(req)
    batch = sched.schedule()
    assert batch.phase == "prefill" and batch.requests == reqs
    land(sched, batch)
    return reqs


def pages_accounted(sched: Scheduler) -> bool:
    held = sum(len(r.pages) for r in sched.running) + sum(len(r.pages) for r in sched.waiting)
    return held + sched.allocator.num_free == sched.allocator.num_usable


def test_a_mixed_step_carries_every_decode_row_then_a_chunk_in_the_budget_left():
    sched = make_scheduler(budget=256)
    decoders = decoding(sched, 10, 20, 30)
    long = make_request(1000, 10)
    sched.add(long)
    starts = []
    while long.prefilling:
        batch = sched.schedule()
        assert batch.is_prefill and batch.is_mixed and batch.phase == "mixed" and batch.num_decode_rows == 3
        assert batch.requests[:3] == decoders and batch.requests[3] is long and batch.size == 4
        assert batch.num_new[:3] == [1, 1, 1] and batch.sample[:3] == [True] * 3
        assert batch.start[:3] == [r.seq_len - 1 for r in decoders]
        assert batch.num_tokens == min(256, 3 + 1000 - long.num_computed)
        assert batch.sample[3] == (batch.start[3] + batch.num_new[3] == 1000)
        starts.append((batch.start[3], batch.num_new[3]))
        land(sched, batch)
    assert starts == [(0, 253), (253, 253), (506, 253), (759, 241)]  # in order, back to back
    assert [len(r.output_ids) for r in decoders] == [5, 5, 5]  # a token every step
    after = sched.schedule()
    assert not after.is_prefill and not after.is_mixed and after.phase == "decode" and after.size == 4


def test_mixed_prefill_tokens_caps_the_chunk_of_a_step_with_decode_rows():
    sched = make_scheduler(budget=256, mixed_prefill_tokens=64)
    decoding(sched, 10, 20)
    sched.add(make_request(300, 10))
    batch = sched.schedule()
    assert batch.num_decode_rows == 2 and batch.num_new[2:] == [64] and batch.num_tokens == 66
    idle = make_scheduler(budget=256, mixed_prefill_tokens=64)
    idle.add(make_request(300, 0))
    alone = idle.schedule()  # no decode rows: a prefill step takes the whole budget
    assert not alone.is_mixed and alone.num_new == [256]


def test_decode_only_and_prefill_only_steps_stay_pure():
    sched = make_scheduler()
    decoding(sched, 5, 6)
    batch = sched.schedule()
    assert not batch.is_prefill and batch.num_decode_rows == 0 and batch.phase == "decode"
    fresh = make_scheduler()
    fresh.add(make_request(40, 0))
    fresh.add(make_request(50, 1))
    first = fresh.schedule()
    assert first.is_prefill and not first.is_mixed and first.phase == "prefill" and first.num_new == [40, 50]


def test_decode_rows_that_fill_the_budget_leave_a_decode_batch():
    sched = make_scheduler(budget=4)
    decoding(sched, 1, 1, 1, 1)
    sched.add(make_request(30, 10))
    batch = sched.schedule()
    assert not batch.is_prefill and batch.size == 4
    land(sched, batch)
    sched.finish(batch.requests[0], "abort")  # one row fewer: three decode rows and one prompt token
    mixed = sched.schedule()
    assert mixed.num_decode_rows == 3 and mixed.num_new == [1, 1, 1, 1] and mixed.num_tokens == 4


def test_mixed_off_keeps_prefill_steps_that_stall_the_decodes():
    sched = make_scheduler(budget=256, mixed=False)
    decoders = decoding(sched, 10, 20)
    sched.add(make_request(600, 10))
    phases = []
    while sched.waiting or any(r.prefilling for r in sched.running):
        batch = sched.schedule()
        phases.append((batch.phase, batch.num_tokens))
        land(sched, batch)
    assert phases == [("prefill", 256), ("prefill", 256), ("prefill", 88)]
    assert [len(r.output_ids) for r in decoders] == [1, 1]  # no token while the prompt prefilled


def test_decode_rows_preempt_the_youngest_as_a_decode_step_does():
    # 9 usable pages: two decoders of 32 tokens (2 full pages each) and a 48-token prompt (3 pages).
    sched = make_scheduler(num_pages=10, budget=64)
    old, young = decoding(sched, 31, 31)
    assert old.seq_len == young.seq_len == 32 and sched.allocator.num_free == 5
    prompt = make_request(48, 10)
    sched.add(prompt)
    first = sched.schedule()  # the decode rows fit their pages; the prompt is admitted beside them
    assert first.phase == "mixed" and first.requests == [old, young, prompt] and sched.allocator.num_free == 2
    land(sched, first)
    batch = sched.schedule()  # every row needs a page, two are free: the youngest is preempted
    assert sched.num_preemptions == 1 and prompt.status is Status.WAITING and sched.waiting[0] is prompt
    assert prompt.num_computed == 0 and len(prompt.pages) == 0 and prompt.prefilling
    # its 49 tokens need 4 pages and 3 are free: not admitted again in the same step
    assert batch.phase == "decode" and batch.requests == [old, young]
    assert pages_accounted(sched)
    land(sched, batch)
    assert [len(r.output_ids) for r in (old, young)] == [3, 3]


def test_a_step_that_preempted_admits_nobody_not_even_its_victim():
    # 9 usable pages: a decoder of 16 tokens, then a 100-token prompt that prefills beside it and
    # decodes until the pages run out. The old decoder's next page preempts the young one (its pages
    # freed: 7 free after the old row's page); the mixed budget left (47 tokens, 3 pages) would re-admit
    # it at once, to recompute what it just lost and be preempted again by the next page the old row
    # needs. vLLM's rule: a step that preempted admits nobody.
    sched = make_scheduler(num_pages=10, budget=48)
    old, = decoding(sched, 15)
    young = make_request(100, 5)
    sched.add(young)
    for _ in range(40):
        before = sched.num_preemptions
        batch = sched.schedule()
        if sched.num_preemptions != before:
            break
        land(sched, batch)
    assert sched.num_preemptions == 1 and young.status is Status.WAITING and sched.waiting[0] is young
    assert batch.phase == "decode" and batch.requests == [old] and sched.allocator.num_free == 7
    assert pages_accounted(sched)
    land(sched, batch)
    nxt = sched.schedule()  # the next step admits it again
    assert nxt.phase == "mixed" and nxt.requests == [old, young] and young.status is Status.RUNNING


def _random_workload(seed: int, mixed: bool) -> tuple[int, int]:
    """Random arrivals, lengths and aborts through the scheduler; checks, every step: the budget,
    page accounting, chunk order, and with mixed steps that every request decoding before a step
    without preemption got a token from it. Returns (steps, preemptions)."""
    rng = random.Random(seed)
    sched = make_scheduler(num_pages=60, budget=128, mixed=mixed, running=12)
    pending = [make_request(rng.randint(1, 300), i, rng.randint(1, 40)) for i in range(60)]
    steps = 0
    while pending or sched.has_work():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        if sched.running and rng.random() < 0.03:
            sched.finish(rng.choice(sched.running), "abort")
        was_decoding = {id(r) for r in sched.running if not r.prefilling}
        preemptions = sched.num_preemptions
        batch = sched.schedule()
        steps += 1
        assert steps < 5000
        if batch is None:
            continue
        if batch.is_prefill:
            assert batch.num_tokens <= 128
        in_batch = {id(r) for r in batch.requests}
        if mixed and sched.num_preemptions == preemptions:
            assert was_decoding <= in_batch  # no running stream skips a step
        # every row continues where its KV ends (chunks in order, none skipped or repeated)
        assert batch.start == [r.num_computed for r in batch.requests]
        land(sched, batch)
        assert pages_accounted(sched)
    assert sched.allocator.num_free == sched.allocator.num_usable
    return steps, sched.num_preemptions


def test_random_workloads_keep_budget_order_pages_and_the_bound():
    for mixed in (True, False):
        assert sum(_random_workload(seed, mixed)[1] for seed in range(6)) > 0  # preemption was exercised


def test_a_mixed_step_message_lays_decode_rows_out_as_one_token_requests():
    """Decode rows first (one input each, a sampled row each; an input still in flight comes from
    the previous step's row), then the chunk; the flag survives the wire form."""
    import pickle

    from worker.step_message import build_step_message

    sched = make_scheduler(budget=64)
    a, b = decoding(sched, 5, 9)
    b.num_pending = 1  # async scheduling: b's last token is sampled by the step in flight
    prompt = make_request(100, 10)
    sched.add(prompt)
    batch = sched.schedule()
    assert batch.requests == [a, b, prompt] and batch.num_new == [1, 1, 62] and batch.sample == [True, True, False]
    msg = build_step_message(batch, [a.seed, b.seed], previous_rows={id(b): 1})
    assert msg.is_prefill and msg.mixed and msg.query_lens == [1, 1, 62]
    assert msg.seq_lens == [a.seq_len, b.seq_len, 62] and msg.positions[:2] == [a.seq_len - 1, b.seq_len - 1]
    assert msg.input_ids[0] == a.output_ids[-1] and msg.from_previous == [(1, 1)]
    assert msg.input_ids[2:] == prompt.prompt_ids[:62] and msg.logits_rows == [0, 1]
    assert msg.steps == [1, 2] and msg.num_requests == 3
    back = pickle.loads(pickle.dumps(msg))
    assert back.mixed and back.query_lens == msg.query_lens and back.from_previous == msg.from_previous
    assert not build_step_message(make_pure_decode(), [0]).mixed


def make_pure_decode() -> ScheduledBatch:
    sched = make_scheduler()
    decoding(sched, 4)
    return sched.schedule()
