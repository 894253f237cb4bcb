"""Prefill graphs on CPU: token buckets, request slots, sentinels, reasons, the debug runner path."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from deploy.config import ConfigError, load_config
from graphs.backends import DebugBackend
from graphs.prefill import (
    HEAD_BUFFER_LIMIT,
    LivePrefillBatch,
    PrefillGraphRunner,
    default_prefill_ladder,
    logits_output,
)
from tests.graph_harness import eager_hidden, fill_cache_randomly, pad_prefill_batch, random_prefill_batch
from tests.reference import OwnModel, rel_err
from worker.attention.base import AttentionBatch
from worker.engine import Engine
from worker.model_steps import ModelPrefillStep
from worker.sampling.params import SamplingParams


def test_default_ladder_about_40_shapes_through_the_chunk_size():
    ladder = default_prefill_ladder(8192)
    assert len(ladder) == 40 and ladder[0] == 64 and ladder[-1] == 8192
    assert all(b > a for a, b in zip(ladder, ladder[1:]))
    assert max(b / a for a, b in zip(ladder[15:], ladder[16:])) <= 1.125
    assert default_prefill_ladder(300) == [64, 128, 192, 256, 300]


def test_ceiling_below_chunk_size_is_rejected_with_the_reason():
    with pytest.raises(ConfigError, match=r"graphs\.prefill\.max_tokens.*chunked_prefill_size.*activation peak"):
        load_config(None, ["scheduler.chunked_prefill_size=4096", "graphs.prefill.max_tokens=2048"])
    with pytest.raises(ConfigError, match="activation peak"):
        load_config(None, ["scheduler.chunked_prefill_size=4096", "graphs.prefill.token_buckets=[64,1024]"])


@pytest.mark.parametrize("requests", range(1, 6))
def test_slot_and_sentinel_layout(requests):
    slots = 4
    live = AttentionBatch.prefill([10 + i for i in range(min(requests, slots))], [3] * min(requests, slots),
                                  [[i + 1] for i in range(min(requests, slots))])
    padded = pad_prefill_batch(live, 64, slots)
    assert padded.num_rows == slots and padded.num_tokens == 64
    assert padded.seq_lens[: live.num_rows] == live.seq_lens
    sentinels = range(live.num_rows, slots)
    assert all(padded.seq_lens[i] == 0 and padded.query_lens[i] == 0 and padded.page_tables[i].size == 0
               for i in sentinels)
    if requests > slots:
        too_many = AttentionBatch.prefill([5] * requests, [1] * requests, [[1]] * requests)
        with pytest.raises(ValueError, match="do not fit 4 request slots"):
            pad_prefill_batch(too_many, 64, slots)


@pytest.fixture(scope="module")
def own(checkpoint_dir):
    own = OwnModel(checkpoint_dir("tiny-qwen2"), num_pages=2048)
    fill_cache_randomly(own)
    return own


def _runner(own, ladder, slots=4, ratio=2.0, metrics=None):
    step = ModelPrefillStep(own.model, own.attention, breakable=True)
    runner = PrefillGraphRunner(step, DebugBackend(torch.device("cpu")), ladder, slots, ratio, metrics,
                                own.model.dtype)
    runner.capture_all(progress=False)
    return runner


def test_bucket_choice_and_reasons(own):
    runner = _runner(own, [64, 128, 256, 512], slots=4)

    def live(tokens, requests):
        return LivePrefillBatch(torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int64),
                                None, requests)

    assert runner.decide(live(64, 1)).size == 64
    assert runner.decide(live(65, 4)).size == 128
    assert runner.decide(live(129, 2)).size == 256
    assert runner.decide(live(100, 5)).reason == "too_many_requests"
    assert runner.decide(live(513, 1)).reason == "batch_too_large"
    assert runner.decide(live(20, 1)).reason == "padding_waste"  # 64 > 2 x 20
    assert _runner(own, [64, 128], ratio=4.0).decide(live(20, 1)).size == 64


def test_debug_prefill_equals_eager(own):
    runner = _runner(own, default_prefill_ladder(512), slots=4)
    rng = random.Random(0)
    for _ in range(12):
        batch = random_prefill_batch(own, rng, rng.randint(1, 4), 90, max_prefix=40)
        choice = runner.decide(batch.live)
        if not choice.replays:
            continue
        n, size = batch.live.num_tokens, choice.size
        padded = LivePrefillBatch(torch.cat([batch.live.input_ids, torch.zeros(size - n, dtype=torch.int64)]),
                                  torch.cat([batch.live.positions, torch.zeros(size - n, dtype=torch.int64)]),
                                  pad_prefill_batch(batch.live.attention, size, runner.slots), runner.slots,
                                  batch.live.rows)
        ref_padded = eager_hidden(own, padded).clone()
        ref_live = eager_hidden(own, batch.live).clone()
        got = runner.execute(batch.live, choice)
        assert torch.equal(got, ref_padded)
        assert rel_err(got, ref_live) <= 1e-5
        assert not runner.buffers.tokens.input_ids[n:size].any() and not runner.buffers.tokens.positions[n:size].any()


def test_sentinels_and_padding_write_nothing_outside_live_pages(own):
    runner = _runner(own, [256], slots=4, ratio=1000.0)
    rng = random.Random(3)
    batch = random_prefill_batch(own, rng, 2, 60, max_prefix=30)
    before = own.cache.kv.clone()
    runner.execute(batch.live, runner.decide(batch.live))
    changed = set((own.cache.kv != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist())
    assert changed - {0} <= batch.pages
    untouched = [p for p in range(1, own.cache.num_pages) if p not in batch.pages]
    assert torch.equal(own.cache.kv[:, untouched], before[:, untouched])


def test_engine_prefill_runner_path(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    registry = CollectorRegistry()
    # no prefix cache: the repeated prompt below must prefill in full (a cached prefix leaves a few
    # tokens, too few for the smallest bucket: padding_waste)
    overrides = [f"model.path={path}", "scheduler.chunked_prefill_size=256", "graphs.prefill.max_tokens=256",
                 "graphs.prefill.num_request_slots=2", "cache.prefix_caching=false"]
    debug = Engine(load_config(None, [*overrides, "graphs.debug=true"]), registry=registry)
    assert len(debug.worker.runner.prefill_runner.ladder) == 4
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(30, 120))] for _ in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = Engine(load_config(None, overrides))
    got = debug.generate(prompts, params)  # up to 5 requests per prefill step: more than the 2 slots
    ref = eager.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert debug.generate(prompts[:1], params)[0].token_ids == ref[0].token_ids  # one request: replays

    def value(reason):
        return registry.get_sample_value("cuda_graph_fallbacks_total", {"phase": "prefill", "reason": reason}) or 0

    assert value("debug") >= 1 and value("too_many_requests") >= 1
    passes = registry.get_sample_value("cuda_graph_passes_total", {"phase": "prefill", "mode": "prefill_none"})
    assert passes == sum(1 for s in debug.step_stats if s.phase == "prefill")


def test_the_runner_keeps_only_the_sampled_rows(own):
    """The one static output is (slots, hidden): the rows a step samples, never (tokens, hidden);
    entries past a smaller batch's rows are reset, so an earlier batch's rows never leak."""
    runner = _runner(own, [128, 256], slots=4, ratio=1000.0)
    assert runner.buffers.out.shape == (4, own.arch.hidden_size)
    rng = random.Random(5)
    big = random_prefill_batch(own, rng, 4, 50)
    runner.execute(big.live, runner.decide(big.live))
    assert runner.buffers.rows.tolist() == big.live.rows.tolist()
    small = random_prefill_batch(own, rng, 2, 50)
    got = runner.execute(small.live, runner.decide(small.live))
    assert got.shape == (2, own.arch.hidden_size)
    assert runner.buffers.rows[2:].tolist() == [0, 0]
    assert rel_err(got, eager_hidden(own, small.live)) <= 1e-5
    none = LivePrefillBatch(small.live.input_ids, small.live.positions, small.live.attention, 2)
    assert runner.execute(none, runner.decide(none)).shape == (0, own.arch.hidden_size)
    five = LivePrefillBatch(small.live.input_ids, small.live.positions, small.live.attention, 2,
                            torch.arange(5))
    assert runner.decide(five).reason == "too_many_requests"


def test_graphs_ending_in_logits_equal_the_eager_lm_head(own):
    """``logits=True``: the LM head runs inside the graph on every slot; the sampled rows' float32
    logits equal the eager head's on the eager hidden rows, and a smaller batch reads only its rows."""
    step = ModelPrefillStep(own.model, own.attention, breakable=True)
    runner = PrefillGraphRunner(step, DebugBackend(torch.device("cpu")), [128, 256], 4, 1000.0, logits=True)
    runner.capture_all(progress=False)
    assert runner.buffers.out.shape == (4, own.arch.vocab_size) and runner.buffers.out.dtype == torch.float32
    rng = random.Random(7)
    for requests in (4, 2, 3):
        batch = random_prefill_batch(own, rng, requests, 50)
        got = runner.execute(batch.live, runner.decide(batch.live))
        want = own.model.compute_logits(eager_hidden(own, batch.live))
        assert got.shape == want.shape == (requests, own.arch.vocab_size)
        assert rel_err(got, want) <= 1e-5


def test_graph_logits_may_land_in_a_shared_buffer(own):
    """``logits_out``: the runner writes into the first ``slots`` rows of a buffer it is handed (the
    decode runner's static logits) and allocates none; a buffer that cannot hold them is refused by name."""
    step = ModelPrefillStep(own.model, own.attention, breakable=True)
    shared = torch.zeros(8, own.arch.vocab_size)
    runner = PrefillGraphRunner(step, DebugBackend(torch.device("cpu")), [128], 4, 1000.0, logits=True,
                                logits_out=shared)
    assert runner.buffers.out.data_ptr() == shared.data_ptr() and runner.buffers.out.shape[0] == 4
    runner.capture_all(progress=False)
    batch = random_prefill_batch(own, random.Random(3), 3, 40)
    got = runner.execute(batch.live, runner.decide(batch.live))
    assert got.data_ptr() == shared.data_ptr()
    assert rel_err(got, own.model.compute_logits(eager_hidden(own, batch.live))) <= 1e-5
    for bad, needle in [(dict(logits_out=shared), "needs logits=True"),
                        (dict(logits=True, logits_out=torch.zeros(3, own.arch.vocab_size)), "cannot hold 4 rows"),
                        (dict(logits=True, logits_out=torch.zeros(8, own.arch.vocab_size + 1)), "cannot hold"),
                        (dict(logits=True, logits_out=shared.double()), "cannot hold")]:
        with pytest.raises(ValueError, match=needle):
            PrefillGraphRunner(step, DebugBackend(torch.device("cpu")), [128], 4, 1000.0, **bad)


def test_the_worker_shares_one_logits_buffer_between_its_phases(checkpoint_dir):
    """With debug graphs for both phases, the worker's prefill graphs write their logits into the
    decode runner's static logits (no second buffer), and generation equals the eager engine's."""
    path = checkpoint_dir("tiny-llama")
    graphs = Engine(load_config(None, [f"model.path={path}", "graphs.debug=true"]))
    runner = graphs.worker.runner
    assert runner.prefill_runner.logits
    assert runner.prefill_runner.buffers.out.data_ptr() == runner.decode_runner.buffers.logits.data_ptr()
    prompts = [[5, 6, 7, 8], list(range(3, 60)), [9] * 3]
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)] * 3
    eager = Engine(load_config(None, [f"model.path={path}", "graphs.enabled=false"]))
    assert [o.token_ids for o in graphs.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]


def test_the_head_goes_into_the_graphs_where_its_buffer_costs_no_more_than_the_workspace_it_saves():
    decode_logits = torch.zeros(256, 1000)
    assert logits_output(decode_logits, 16, 1000) == (True, decode_logits)
    assert logits_output(decode_logits, 257, 1000) == (True, None)  # too few rows: a small buffer of its own
    assert logits_output(None, 16, 128_256) == (True, None)  # 8 MiB
    assert logits_output(None, 256, 128_256) == (False, None)  # 125 MiB: hidden states out, the head eager
    assert logits_output(None, HEAD_BUFFER_LIMIT // (4 * 1000), 1000)[0]
    assert not logits_output(None, HEAD_BUFFER_LIMIT // (4 * 1000) + 1, 1000)[0]
