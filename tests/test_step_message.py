"""A decode batch's step message (its own fast path) equals the general one, token for token."""

from __future__ import annotations

import dataclasses
import random

import pytest

from worker.request import Request
from worker.sampling.params import SamplingParams
from worker.scheduler import ScheduledBatch
from worker.step_message import build_step_message


def _requests(rng: random.Random) -> tuple[list[Request], dict[int, int]]:
    reqs, previous_rows = [], {}
    for i in range(12):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(1, 40))]
        req = Request(f"r{i}", prompt, SamplingParams(temperature=0.5 + i / 10), 100 + i, i)
        req.output_ids = [rng.randrange(10, 1000) for _ in range(rng.randint(0, 30))]
        req.num_pending = 1 if (req.output_ids and rng.random() < 0.5) or not req.output_ids else 0
        req.pages = [rng.randrange(1, 500) for _ in range(-(-req.seq_len // 16))]
        if req.num_pending:
            previous_rows[id(req)] = rng.randrange(0, 64)
        reqs.append(req)
    return reqs, previous_rows


def test_a_decode_message_equals_the_general_one():
    rng = random.Random(0)
    for _ in range(50):
        reqs, previous_rows = _requests(rng)
        rng.shuffle(reqs)
        # The last token is the input: in flight (pending) or the last known one.
        batch = ScheduledBatch(False, reqs, [r.seq_len - 1 for r in reqs], [1] * len(reqs), [True] * len(reqs))
        seeds = [r.seed for r in reqs]
        fast = build_step_message(batch, seeds, previous_rows=previous_rows)
        general = build_step_message(dataclasses.replace(batch, is_prefill=True), seeds, previous_rows=previous_rows)
        assert not fast.is_prefill
        for f in dataclasses.fields(fast):
            if f.name != "is_prefill":
                assert getattr(fast, f.name) == getattr(general, f.name), f.name


def test_a_decode_token_that_nothing_in_flight_samples_is_refused():
    req = Request("r", [5, 6, 7], SamplingParams(), 1, 0)
    req.output_ids, req.num_pending = [8], 1
    batch = ScheduledBatch(False, [req], [req.seq_len - 1], [1], [True])
    with pytest.raises(ValueError, match="input token 4 is not known"):
        build_step_message(batch, [1], previous_rows={})
    with pytest.raises(ValueError, match="one new, sampled token"):
        build_step_message(ScheduledBatch(False, [req], [2], [2], [True]), [1])
