"""worker.sampling.logprob_graphs on CPU, with a stand-in for CUDA graph capture that re-runs the
recorded function into the same static outputs: buckets, static buffers, the shapes it captures and
replays, the cache's bound, the eager fallbacks, and what the packed read-back rows hold."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.readback import sample_lists
from worker.sampling import SamplingParams
from worker.sampling.logprob_graphs import LogprobGraphs, logprob_tail
from worker.sampling.logprobs import logprobs_of
from worker.sampling.packed_rows import (
    PACKED_COLUMNS,
    alternatives,
    first_alternatives,
    pack,
    spelled_entries,
    unpack_lists,
)
from worker.sampling.params import MAX_TOP_LOGPROBS
from worker.sampling.sampler import SamplingBatch, sample

CPU = torch.device("cpu")
ROWS, VOCAB = 16, 1000


class Rerun:
    """A CPU stand-in for a captured graph: its outputs are static, and ``replay`` recomputes
    the recorded function from the static inputs into them."""

    def __init__(self, fn):
        self.fn, self.outputs, self.resets = fn, fn(), 0

    def replay(self):
        for static, fresh in zip(self.outputs, self.fn()):
            if static is not None:
                static.copy_(fresh)

    def reset(self):
        self.resets += 1


class Recorder:
    """A capture function that records what it captured."""

    def __init__(self, fail: bool = False):
        self.graphs: list[Rerun] = []
        self.fail = fail

    def __call__(self, fn, device):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = Rerun(fn)
        self.graphs.append(graph)
        return graph, graph.outputs


def _inputs(rows: int, seed: int, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3, torch.randint(0, vocab, (rows,), generator=g)


def _assert_tail_equal(got, logits, tokens, width):
    chosen, ids, values = logprobs_of(logits.to(torch.float32), tokens, width)
    assert torch.equal(got[0], chosen)
    if not width:
        assert got[1] is None and got[2] is None
    else:
        assert torch.equal(got[1], ids) and torch.equal(got[2], values)
    if got[3] is not None:
        assert torch.equal(got[3], pack(tokens, chosen, ids, values))


@pytest.mark.parametrize("width", [0, MAX_TOP_LOGPROBS])
def test_replays_equal_eager_for_every_batch_and_capture_only_buckets(width):
    capture = Recorder()
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=capture)
    assert graphs.ladder == [1, 2, 4, 8, 16]
    for rows in (13, 1, 3, 8, 16, 5):
        logits, tokens = _inputs(rows, rows)
        got = graphs(logits, tokens, width)
        _assert_tail_equal(got, logits, tokens, width)
        assert got[3] is not None and got[3].shape == (rows, 2 + 2 * width)
    # the largest bucket first (its scratch is the pool's growth), then each bucket once
    assert [g.outputs[0].shape[0] for g in capture.graphs] == [16, 1, 4, 8]
    assert graphs.captured == [(b, width) for b in (1, 4, 8, 16)]
    assert graphs.replays == 6


def test_a_second_call_replays_with_its_own_inputs_and_stale_rows_do_not_leak():
    capture = Recorder()
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=capture)
    big, big_tokens = _inputs(16, 0)
    graphs(big, big_tokens, MAX_TOP_LOGPROBS)
    captured = list(graphs.captured)
    for seed in (1, 2, 3):  # 13 rows replay the 16-row graph over the 16-row call's stale rows
        logits, tokens = _inputs(13, seed)
        _assert_tail_equal(graphs(logits, tokens, MAX_TOP_LOGPROBS), logits, tokens, MAX_TOP_LOGPROBS)
    assert graphs.captured == captured and len(capture.graphs) == 1 and graphs.replays == 4


def test_outputs_are_static_views_overwritten_by_the_next_call_of_the_shape():
    """The hazard the read-back's stream order guards against: a later call of the same shape
    rewrites the earlier call's outputs, so they must be copied (enqueued) before it."""
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=Recorder())
    first_logits, first_tokens = _inputs(6, 1)
    first = graphs(first_logits, first_tokens, MAX_TOP_LOGPROBS)
    read_before = [None if t is None else t.clone() for t in first]  # what the queued copy takes
    second_logits, second_tokens = _inputs(7, 2)  # same bucket (8)
    second = graphs(second_logits, second_tokens, MAX_TOP_LOGPROBS)
    _assert_tail_equal(read_before, first_logits, first_tokens, MAX_TOP_LOGPROBS)
    _assert_tail_equal(second, second_logits, second_tokens, MAX_TOP_LOGPROBS)
    assert first[0].data_ptr() == second[0].data_ptr()
    assert torch.equal(first[0], second[0][:6])  # the first call's views now hold the second's values


class _Copies(TorchDispatchMode):
    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ == "copy_" and tuple(args[0].shape) == self.shape:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_static_inputs_own_rows_are_not_copied_and_other_logits_are():
    static = torch.zeros(ROWS, VOCAB)
    graphs = LogprobGraphs(static, capture=Recorder())
    logits, tokens = _inputs(5, 3)
    graphs(logits, tokens, 0)  # captures outside the op count
    static[:5] = logits  # a replayed decode step: its logits are the runner's static rows [0, n)
    with _Copies((5, VOCAB)) as copies:
        got = graphs(static[:5], tokens, 0)
    assert copies.count == 0
    _assert_tail_equal(got, logits, tokens, 0)
    with _Copies((5, VOCAB)) as copies:
        got = graphs(logits.clone(), tokens, 0)
    assert copies.count == 1
    _assert_tail_equal(got, logits, tokens, 0)
    half = logits.to(torch.bfloat16)  # upcast by the copy, exactly as .to(float32)
    _assert_tail_equal(graphs(half, tokens, 0), half, tokens, 0)


def test_eager_outside_the_cache_and_the_cache_stays_bounded():
    capture = Recorder()
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=capture)
    for rows in range(1, ROWS + 1):
        for width in (0, MAX_TOP_LOGPROBS):
            logits, tokens = _inputs(rows, rows * 31 + width)
            _assert_tail_equal(graphs(logits, tokens, width), logits, tokens, width)
    assert len(capture.graphs) == len(graphs.ladder) * 2
    replays = graphs.replays
    for logits, tokens, width in [(*_inputs(ROWS + 1, 0), 0), (*_inputs(4, 0, vocab=VOCAB + 1), 0),
                                  (*_inputs(4, 0), 3)]:  # too many rows, another vocabulary, another width
        got = graphs(logits, tokens, width)
        assert got[3] is None
        _assert_tail_equal(got, logits, tokens, width)
    assert graphs.replays == replays and len(capture.graphs) == len(graphs.ladder) * 2
    assert len(graphs._served) == ROWS * 2  # one entry per (rows, width) that replays: bounded


def test_a_failed_capture_runs_eagerly_and_is_not_retried(caplog):
    capture = Recorder(fail=True)
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=capture)
    for seed in (1, 2):
        logits, tokens = _inputs(3, seed)
        got = graphs(logits, tokens, MAX_TOP_LOGPROBS)
        assert got[3] is None
        _assert_tail_equal(got, logits, tokens, MAX_TOP_LOGPROBS)
    assert graphs.captured == [] and graphs.replays == 0
    assert sum("not captured" in r.message for r in caplog.records) == 2  # the largest bucket and bucket 4, once


def test_without_a_capture_function_a_cpu_buffer_is_always_eager():
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB))
    logits, tokens = _inputs(4, 0)
    got = graphs(logits, tokens, MAX_TOP_LOGPROBS)
    assert got[3] is None and graphs.captured == []
    _assert_tail_equal(got, logits, tokens, MAX_TOP_LOGPROBS)
    with pytest.raises(ValueError, match="float32"):
        LogprobGraphs(torch.zeros(ROWS, VOCAB, dtype=torch.bfloat16))


def test_release_resets_every_graph_and_later_calls_capture_again():
    capture = Recorder()
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=capture)
    logits, tokens = _inputs(3, 0)
    graphs(logits, tokens, 0)
    graphs.release()
    assert [g.resets for g in capture.graphs] == [1, 1] and graphs.captured == []
    _assert_tail_equal(graphs(logits, tokens, 0), logits, tokens, 0)
    assert len(capture.graphs) == 4


PARAMS = [SamplingParams(temperature=0, logprobs=True, top_logprobs=5), SamplingParams(seed=3, logprobs=True),
          SamplingParams(temperature=0.7, top_k=20, logprobs=True, logit_bias={4: 30.0}),
          SamplingParams(temperature=0, logprobs=True, presence_penalty=0.5)]


@pytest.mark.parametrize("params", [PARAMS, PARAMS[:2], [SamplingParams(temperature=0, logprobs=True)] * 3])
def test_sample_with_graphs_equals_sample_without(params):
    """The sampler's tokens and raw (unbiased) log-probabilities are the same through the graphs,
    and its packed rows read back as the lists of the separate tensors."""
    n = len(params)
    logits, _ = _inputs(n, 11)
    graphs = LogprobGraphs(torch.zeros(ROWS, VOCAB), capture=Recorder())
    batch = SamplingBatch.build(params, list(range(n)), [2] * n, CPU, vocab_size=VOCAB)
    want = sample(logits, batch)
    got = sample(logits, batch, logprob_graphs=graphs)
    assert want.packed is None and got.packed is not None and graphs.replays == 1
    for a, b in zip(want[:4], got[:4]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert sample_lists(got) == sample_lists(want)
    tokens, lps, tops = sample_lists(want)
    assert (tokens, lps) == (want.token_ids.tolist(), want.logprobs.tolist())
    if want.top_ids is None:
        assert tops is None
    else:  # rows of bytes, spelled as the lists of the tensors
        assert [alternatives(i, v) for i, v in zip(*tops)] == \
            list(zip(want.top_ids.tolist(), want.top_logprobs.tolist()))


@pytest.mark.parametrize("width", [0, MAX_TOP_LOGPROBS])
def test_a_greedy_batch_over_the_static_rows_samples_into_the_static_token_rows(width):
    """All greedy over the static input's own rows: the argmax goes straight into the graphs' static
    token rows (``token_rows``), which the replay reads without a copy; the step's tokens are that
    view (the next call rewrites it) and equal sampling without graphs. A sampled batch, or logits
    that are not the static rows, gets a token tensor of its own."""
    static = torch.zeros(ROWS, VOCAB)
    graphs = LogprobGraphs(static, capture=Recorder())
    greedy = [SamplingParams(temperature=0, logprobs=True, top_logprobs=width)] * 5
    batch = SamplingBatch.build(greedy, list(range(5)), [2] * 5, CPU, vocab_size=VOCAB)
    for seed in (1, 2):
        logits, _ = _inputs(5, seed)
        static[:5].copy_(logits)
        got = sample(static[:5], batch, logprob_graphs=graphs)
        want = sample(logits, batch)
        assert got.token_ids.data_ptr() == graphs.token_rows(static[:5], width).data_ptr()
        assert got.packed is not None
        for a, b in zip(want[:4], got[:4]):
            assert (a is None and b is None) or torch.equal(a, b)
        assert torch.equal(got.packed[:, 0], want.token_ids.to(torch.int32))
    assert graphs.token_rows(logits, width) is None  # not the static rows
    sampled = SamplingBatch.build([SamplingParams(seed=1, logprobs=True, top_logprobs=width)] * 5, list(range(5)),
                                  [2] * 5, CPU, vocab_size=VOCAB)
    out = sample(static[:5], sampled, logprob_graphs=graphs)
    assert out.token_ids.data_ptr() != graphs.token_rows(static[:5], width).data_ptr()
    assert torch.equal(out.packed[:, 0], out.token_ids.to(torch.int32))  # its tokens copied in for the replay


@pytest.mark.parametrize("width", [0, 1, MAX_TOP_LOGPROBS])
def test_packed_rows_read_back_exactly_the_lists_of_the_tensors(width):
    g = torch.Generator().manual_seed(width)
    n = 9
    tokens = torch.randint(0, 2**31 - 1, (n,), generator=g)
    chosen = torch.randn(n, generator=g) * 1e3
    chosen[0], chosen[1], chosen[2] = -math.inf, -0.0, torch.finfo(torch.float32).tiny / 4  # a subnormal
    ids = torch.randint(0, 2**31 - 1, (n, width), generator=g) if width else None
    values = torch.randn(n, width, generator=g).log_softmax(-1) if width else None
    if width:
        values[3] = -math.inf
    packed = pack(tokens, chosen, ids, values)
    assert packed.dtype == torch.int32 and packed.shape == (n, 2 + 2 * width) and packed.shape[1] <= PACKED_COLUMNS
    got_tokens, got_lps, tops = unpack_lists(packed.numpy())
    assert got_tokens == tokens.tolist() and all(type(t) is int for t in got_tokens)
    assert got_lps == chosen.tolist() and all(type(x) is float for x in got_lps)
    assert math.copysign(1.0, got_lps[1]) == -1.0
    if not width:
        assert tops is None
    else:
        assert all(type(r) is bytes and len(r) == 4 * width for r in tops[0] + tops[1])
        spelled = [alternatives(i, v) for i, v in zip(*tops)]
        assert spelled == list(zip(ids.tolist(), values.tolist()))
        assert all(type(i) is int for i in spelled[0][0]) and all(type(v) is float for v in spelled[0][1])
        assert alternatives(*first_alternatives(tops[0][4], tops[1][4], 1)) == ([ids[4, 0].item()],
                                                                                 [values[4, 0].item()])
        assert first_alternatives(tops[0][4], tops[1][4], width) == (tops[0][4], tops[1][4])
        entries = [0.5, (-1.0, tops[0][2], tops[1][2]), (-2.0, [7], [-3.0])]
        assert spelled_entries(entries) == [0.5, (-1.0, *spelled[2]), (-2.0, [7], [-3.0])]


def test_logprob_tail_is_logprobs_of_with_its_packed_rows():
    logits, tokens = _inputs(4, 5)
    chosen, ids, values, packed = logprob_tail(logits, tokens, 3)
    want = logprobs_of(logits, tokens, 3)
    assert all(torch.equal(a, b) for a, b in zip((chosen, ids, values), want))
    assert torch.equal(packed, pack(tokens, *want))


def test_a_cpu_model_runner_has_no_logprob_graphs():
    from types import SimpleNamespace

    from worker.model_runner import ModelRunner

    decode = SimpleNamespace(buffers=SimpleNamespace(logits=torch.zeros(4, VOCAB)), release=lambda: None)
    runner = ModelRunner(SimpleNamespace(device=CPU), None, decode, SimpleNamespace(release=lambda: None),
                         logprob_graphs=True)
    assert runner.logprob_graphs is None
    runner.release_graphs()
