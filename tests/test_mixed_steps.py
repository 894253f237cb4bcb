"""Mixed steps through the engine on CPU: outputs equal with them on and off (and unchunked), a
running stream's wait while long prompts arrive, sampling features in mixed steps, and mixed batches
through the prefill runner's path (debug backend: padding, sentinels, counted as ``mixed``)."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from deploy.config import load_config
from graphs.backends import DebugBackend
from graphs.metrics import GraphMetrics
from graphs.prefill import LivePrefillBatch, PrefillGraphRunner, default_prefill_ladder
from tests.graph_harness import eager_hidden, fill_cache_randomly, pad_prefill_batch, random_mixed_batch
from tests.reference import OwnModel, rel_err
from worker.engine import Engine
from worker.model_steps import ModelPrefillStep
from worker.sampling.params import SamplingParams


def make_engine(path, mixed: bool, *overrides: str, registry: CollectorRegistry | None = None) -> Engine:
    return Engine(load_config(None, [f"model.path={path}", f"scheduler.mixed_steps={str(mixed).lower()}",
                                     *overrides]), registry=registry)


def _random_requests(seed: int, count: int) -> list[tuple[list[int], int, int | None]]:
    """``(prompt, max_tokens, abort after this many output tokens or None)``: prompts share a few
    prefixes, many are longer than a 128-token chunk, a fifth are aborted (some before any token)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1024) for _ in range(rng.randint(20, 120))] for _ in range(6)]
    out = []
    for _ in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1024) for _ in range(rng.randint(1, 60))]
        max_tokens = rng.randint(1, 24)
        abort_at = rng.randint(0, max_tokens - 1) if rng.random() < 0.2 else None
        out.append((prompt, max_tokens, abort_at))
    return out


def _run_staggered(engine: Engine, requests, seed: int) -> dict[int, tuple[list[int], str]]:
    """Add ``requests`` a few per step, abort each marked one once it has that many output tokens;
    returns each request's (tokens, finish reason) by index, after checking every page came back."""
    rng = random.Random(seed)
    free = engine.num_free_pages
    ids: dict[str, int] = {}
    aborts: dict[str, int] = {}
    pending = list(enumerate(requests))
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, (prompt, max_tokens, abort_at) = pending.pop(0)
                rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                ignore_eos=True))
                ids[rid] = i
                if abort_at is not None:
                    aborts[rid] = abort_at
        engine.step()
        steps += 1
        assert steps < 20_000
        for rid, at in list(aborts.items()):
            if len(engine.requests[rid].output_ids) >= at:
                engine.abort(rid)
                del aborts[rid]
    assert engine.num_free_pages == free and not engine.in_flight
    return {i: (engine.output(rid).token_ids, engine.output(rid).finish_reason) for rid, i in ids.items()}


def test_200_random_greedy_requests_equal_with_mixed_steps_on_and_off(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    requests = _random_requests(11, 200)
    tight = ["cache.num_pages=48", "scheduler.max_running_requests=24", "scheduler.chunked_prefill_size=128",
             "scheduler.max_num_batched_tokens=128", "graphs.prefill.max_tokens=128"]
    results, engines = {}, {}
    for mixed in (True, False):  # prefix caching off: its shared pages would spare the preemptions
        engines[mixed] = engine = make_engine(path, mixed, *tight, "cache.prefix_caching=false")
        results[mixed] = _run_staggered(engine, requests, seed=3)
        assert engine.scheduler.num_preemptions >= 1
    cached = make_engine(path, True, *tight)  # both on (the defaults): the same tokens
    assert _run_staggered(cached, requests, seed=3) == results[True]
    assert cached.scheduler.cache_stats.hits > 0
    phases = {s.phase for s in engines[True].step_stats}
    assert phases == {"prefill", "decode", "mixed"} and "mixed" not in {s.phase for s in engines[False].step_stats}
    assert max(s.num_tokens for s in engines[True].step_stats if s.phase != "decode") <= 128
    assert results[True] == results[False]
    for i, (_, max_tokens, abort_at) in enumerate(requests):
        tokens, reason = results[True][i]
        assert (reason, len(tokens)) == (("abort", abort_at) if abort_at is not None else ("length", max_tokens))
    whole = make_engine(path, False).generate(  # unchunked, roomy: no preemption
        [p for p, _, a in requests if a is None],
        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m, a in requests if a is None])
    assert [o.token_ids for o in whole] == [results[True][i][0] for i, r in enumerate(requests) if r[2] is None]
    aborted = [i for i, r in enumerate(requests) if r[2] is not None]
    assert any(requests[i][2] == 0 for i in aborted) and any(requests[i][2] > 0 for i in aborted)


def _stream_while_prompts_arrive(path, mixed: bool, async_scheduling: bool) -> tuple[list[int], list[int]]:
    """One greedy stream decodes while 8 prompts of 200 tokens arrive; per gap between two of its
    tokens until every prompt has finished, the engine steps and the tokens those steps computed
    (with async scheduling a step's tokens and stats come back in the engine step after it)."""
    engine = make_engine(path, mixed, "scheduler.chunked_prefill_size=64", "scheduler.max_num_batched_tokens=64",
                         "graphs.prefill.max_tokens=64",
                         f"scheduler.async_scheduling={str(async_scheduling).lower()}")
    stream = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    while len(engine.requests[stream].output_ids) < 3:
        engine.step()
    rng = random.Random(0)
    prompts = [engine.add_request([rng.randrange(3, 1024) for _ in range(200)],
                                  SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)) for _ in range(8)]
    gaps_steps, gaps_tokens = [], []
    steps = tokens = 0
    while not all(engine.requests[p].finished for p in prompts):
        before = len(engine.step_stats)
        events = engine.step()
        steps += 1
        tokens += sum(s.num_tokens for s in list(engine.step_stats)[before:])
        if any(ev.request_id == stream and ev.token_ids for ev in events):
            gaps_steps.append(steps)
            gaps_tokens.append(tokens)
            steps = tokens = 0
    assert not engine.requests[stream].finished
    return gaps_steps, gaps_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_streams_longest_gap_is_one_step_of_the_budget_with_mixed_steps(checkpoint_dir, async_scheduling):
    path = checkpoint_dir("tiny-llama")
    mixed_steps, mixed_tokens = _stream_while_prompts_arrive(path, True, async_scheduling)
    # no step passes without the stream's token; each step computes at most the 64-token budget
    assert max(mixed_steps) == 1 and max(mixed_tokens) <= 64
    plain_steps, plain_tokens = _stream_while_prompts_arrive(path, False, async_scheduling)
    # prefill first: the stream waits for every chunk of the 8 prompts (1600 tokens, 25 steps of 64)
    assert max(plain_steps) >= 25 and max(plain_tokens) >= 1600, (plain_steps, plain_tokens)
    assert sum(mixed_steps) < sum(plain_steps) + 16  # the prompts' prefill is not slower by more than it gives


def test_sampling_features_in_mixed_steps_equal_mixed_off(checkpoint_dir):
    """Penalties, log-probabilities, logit bias, prompt log-probabilities and seeded sampling of
    rows in mixed steps (async scheduling: decode rows' inputs are the previous step's tokens)."""
    path = checkpoint_dir("tiny-llama")
    rng = random.Random(4)
    kinds = [dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
             dict(temperature=0, logprobs=True, top_logprobs=3),
             dict(temperature=0, logit_bias=((17, 100.0),)),
             dict(temperature=0, prompt_logprobs=2),
             dict(temperature=0.9, seed=77, top_p=0.9),
             dict(temperature=0.7, seed=5, frequency_penalty=0.8, logprobs=True)]
    work = [([rng.randrange(3, 1024) for _ in range(rng.randint(10, 150))],
             SamplingParams(max_tokens=rng.randint(5, 25), ignore_eos=True, **kinds[i % len(kinds)]))
            for i in range(18)]
    outs = {}
    for mixed in (True, False):
        engine = make_engine(path, mixed, "scheduler.chunked_prefill_size=64", "scheduler.max_num_batched_tokens=64",
                             "graphs.prefill.max_tokens=64", "cache.num_pages=40")
        ids = []
        pending = list(work)
        while pending or engine.has_unfinished():
            if pending:
                ids.append(engine.add_request(*pending.pop(0)))
            engine.step()
        outs[mixed] = [engine.output(i) for i in ids]
        if mixed:
            assert sum(s.phase == "mixed" for s in engine.step_stats) >= 10
    for got, ref in zip(outs[True], outs[False]):
        assert got.token_ids == ref.token_ids
        if ref.logprobs is not None:
            assert [None if isinstance(e, float) else e[1] for e in got.logprobs] == \
                   [None if isinstance(e, float) else e[1] for e in ref.logprobs]  # the alternatives' ids
            lp = [e if isinstance(e, float) else e[0] for e in got.logprobs]
            lp_ref = [e if isinstance(e, float) else e[0] for e in ref.logprobs]
            assert max(abs(a - b) for a, b in zip(lp, lp_ref)) <= 1e-4
        if ref.prompt_logprobs is not None:
            assert len(got.prompt_logprobs) == len(ref.prompt_logprobs)
            assert max(abs(a[0] - b[0]) for a, b in zip(got.prompt_logprobs, ref.prompt_logprobs)) <= 1e-4
    assert any(17 in o.token_ids for o in outs[True])


def test_engine_mixed_steps_through_the_prefill_runner_counted_as_mixed(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    common = ["scheduler.chunked_prefill_size=128", "scheduler.max_num_batched_tokens=128",
              "graphs.prefill.max_tokens=128", "scheduler.max_running_requests=12"]
    rng = random.Random(8)
    requests = [([rng.randrange(3, 1024) for _ in range(rng.randint(20, 200))], rng.randint(3, 20), None)
                for _ in range(24)]
    registry = CollectorRegistry()
    debug = make_engine(path, True, *common, "graphs.debug=true", registry=registry)
    assert debug.worker.runner.prefill_runner.slots == 12  # default: a slot per running request
    got = _run_staggered(debug, requests, seed=1)
    assert got == _run_staggered(make_engine(path, True, *common), requests, seed=1)
    assert got == _run_staggered(make_engine(path, False, *common), requests, seed=1)

    def passes(phase):
        return registry.get_sample_value("cuda_graph_passes_total", {"phase": phase, "mode": f"{phase}_none"}) or 0

    def fallbacks(phase, reason):
        return registry.get_sample_value("cuda_graph_fallbacks_total", {"phase": phase, "reason": reason}) or 0

    counts = {phase: sum(s.phase == phase for s in debug.step_stats) for phase in ("prefill", "decode", "mixed")}
    assert counts["mixed"] >= 10 and counts["decode"] >= 1
    assert {phase: passes(phase) for phase in counts} == counts  # decode-only steps stay on the decode runner
    # replayed through the runner path (the debug backend counts "debug"), padding_waste aside
    assert fallbacks("mixed", "debug") + fallbacks("mixed", "padding_waste") == counts["mixed"]
    assert fallbacks("mixed", "debug") >= 1 and fallbacks("mixed", "too_many_requests") == 0

    few = CollectorRegistry()  # fewer slots than a mixed step's rows: eager, counted with the reason
    narrow = make_engine(path, True, *common, "graphs.debug=true", "graphs.prefill.num_request_slots=2",
                         registry=few)
    assert _run_staggered(narrow, requests, seed=1) == got
    assert few.get_sample_value("cuda_graph_fallbacks_total", {"phase": "mixed", "reason": "too_many_requests"}) >= 1


@pytest.fixture(scope="module")
def own(checkpoint_dir):
    own = OwnModel(checkpoint_dir("tiny-qwen2"), num_pages=2048)
    fill_cache_randomly(own)
    return own


def test_mixed_batches_through_the_debug_prefill_runner_equal_eager(own):
    slots = 16
    step = ModelPrefillStep(own.model, own.attention, breakable=True)
    registry = CollectorRegistry()
    runner = PrefillGraphRunner(step, DebugBackend(torch.device("cpu")), default_prefill_ladder(512), slots, 1000.0,
                                GraphMetrics(registry), own.model.dtype)
    runner.capture_all(progress=False)
    rng = random.Random(2)
    replayed = 0
    for _ in range(10):
        live = random_mixed_batch(own, rng, rng.randint(1, 10), rng.randint(1, 4))
        choice = runner.decide(live)
        assert choice.replays, choice.reason
        n, size = live.num_tokens, choice.size
        padded = LivePrefillBatch(torch.cat([live.input_ids, torch.zeros(size - n, dtype=torch.int64)]),
                                  torch.cat([live.positions, torch.zeros(size - n, dtype=torch.int64)]),
                                  pad_prefill_batch(live.attention, size, slots), slots, live.rows)
        ref_padded = eager_hidden(own, padded).clone()
        ref_live = eager_hidden(own, live).clone()
        got = runner.execute(live, choice, "mixed")
        assert got.shape == (live.num_rows, own.arch.hidden_size)
        assert torch.equal(got, ref_padded) and rel_err(got, ref_live) <= 1e-5
        assert not runner.buffers.tokens.input_ids[n:size].any()  # tail padding reset
        assert runner.buffers.rows[live.num_rows:].eq(0).all()  # unused sample rows reset
        replayed += 1
    assert registry.get_sample_value("cuda_graph_passes_total", {"phase": "mixed", "mode": "mixed_none"}) == replayed
    assert registry.get_sample_value("cuda_graph_passes_total", {"phase": "prefill", "mode": "prefill_none"}) is None
