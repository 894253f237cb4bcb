"""worker.sampling.logprob_graphs on the GPU: replayed log-probabilities equal eager ``logprobs_of``
for several batches and widths, a later call replays (no new capture) with its own inputs, a step's
outputs read back intact although the next step's replay rewrites them, and a call inside another
capture is recorded eagerly into it."""

from __future__ import annotations

import pytest
import torch

from worker.readback import TokenReadback
from worker.sampling.logprob_graphs import LogprobGraphs
from worker.sampling.logprobs import logprobs_of
from worker.sampling.packed_rows import alternatives
from worker.sampling.params import MAX_TOP_LOGPROBS
from worker.sampling.sampler import SampleOutput

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _inputs(rows: int, vocab: int, seed: int):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    logits = torch.randn(rows, vocab, device=CUDA, generator=g) * 4  # float32: no ties among the top entries
    return logits, torch.randint(0, vocab, (rows,), device=CUDA, generator=g)


def _assert_equals_eager(got, logits, tokens, width):
    """``got`` (a LogprobGraphs result) equals eager ``logprobs_of``; its packed rows, when it has
    them, hold the same tokens, log-probabilities and alternatives."""
    chosen, ids, values = logprobs_of(logits.float(), tokens, width)
    assert torch.equal(got[0], chosen)
    if not width:
        assert got[1] is None and got[2] is None
    else:
        assert torch.equal(got[2], values)
        # among equal values ``topk`` promises no order: equal ids, or ids holding the same values
        assert torch.equal(got[1], ids) or torch.equal(logits.float().log_softmax(-1).gather(1, got[1]), values)
    if got[3] is None:
        return
    assert got[3].shape == (len(tokens), 2 + 2 * width)
    assert torch.equal(got[3][:, 0], tokens.to(torch.int32))
    assert torch.equal(got[3][:, 1].view(torch.float32), chosen)
    if width:
        assert torch.equal(got[3][:, 2:2 + width], got[1].to(torch.int32))
        assert torch.equal(got[3][:, 2 + width:].view(torch.float32), values)


@pytest.mark.parametrize("vocab", [32000, 1000])
def test_replayed_logprobs_equal_eager_and_a_second_call_replays(vocab):
    graphs = LogprobGraphs(torch.zeros(64, vocab, device=CUDA))
    sizes = (1, 5, 8, 13, 40, 64)
    for width in (0, MAX_TOP_LOGPROBS):
        for rows in sizes:
            logits, tokens = _inputs(rows, vocab, rows + width)
            _assert_equals_eager(graphs(logits, tokens, width), logits, tokens, width)
    captured, replays = graphs.captured, graphs.replays
    assert replays == 2 * len(sizes) and all(w in (0, MAX_TOP_LOGPROBS) for _, w in captured)
    for width in (0, MAX_TOP_LOGPROBS):  # new inputs: replays of the same graphs, right for their inputs
        for rows in sizes:
            logits, tokens = _inputs(rows, vocab, 1000 + rows + width)
            _assert_equals_eager(graphs(logits, tokens, width), logits, tokens, width)
            static = graphs._logits  # a replayed decode step: its logits are the static rows themselves
            static[:rows] = logits
            _assert_equals_eager(graphs(static[:rows], tokens, width), logits, tokens, width)
    assert graphs.captured == captured and graphs.replays == replays + 4 * len(sizes)
    half, tokens = _inputs(7, vocab, 7)
    half = half.to(torch.bfloat16)  # the copy into the static input is the upcast (bf16 has ties: ids may differ)
    _assert_equals_eager(graphs(half, tokens, MAX_TOP_LOGPROBS), half, tokens, MAX_TOP_LOGPROBS)
    assert graphs.captured == captured
    graphs.release()


def test_a_steps_outputs_read_back_intact_behind_the_next_steps_replay():
    """Step N's outputs are static views that step N+1's replay rewrites; the read-back's copy is
    queued first on the same stream, so it still takes step N's values (with the device kept busy
    so that the copy is pending when step N+1 is queued)."""
    vocab = 32000
    graphs = LogprobGraphs(torch.zeros(64, vocab, device=CUDA))
    readback = TokenReadback()
    # a first step: the capture and the read-back's pinned slots come before the device is kept busy
    warm, warm_tokens = _inputs(64, vocab, 0)
    chosen, ids, values, packed = graphs(warm, warm_tokens, MAX_TOP_LOGPROBS)
    warm_copy = readback.copy(SampleOutput(warm_tokens, chosen, ids, values, packed=packed), ("decode", 64), 0.0)
    assert readback.wait(warm_copy, newest=True)[1] == logprobs_of(warm, warm_tokens, 0)[0].tolist()
    steps = [_inputs(60, vocab, seed) for seed in (1, 2)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of both steps
    copies, outs = [], []
    for logits, tokens in steps:
        chosen, ids, values, packed = graphs(logits, tokens, MAX_TOP_LOGPROBS)
        outs.append(SampleOutput(tokens, chosen, ids, values, packed=packed))
        copies.append(readback.copy(outs[-1], ("decode", 60), 0.0))  # as Worker.launch, before the next step
    assert outs[0].packed.data_ptr() == outs[1].packed.data_ptr()  # the same static rows, rewritten
    for (logits, tokens), copy in zip(steps, copies):
        got_tokens, got_lps, tops, _, _, _ = readback.wait(copy, newest=copy is copies[-1])
        chosen, ids, values = logprobs_of(logits, tokens, MAX_TOP_LOGPROBS)
        assert got_tokens == tokens.tolist()
        assert got_lps == chosen.tolist()
        top_ids, top_values = zip(*(alternatives(i, v) for i, v in zip(*tops)))  # rows of bytes, spelled
        assert list(top_values) == values.tolist()
        got_ids = torch.tensor(top_ids, device=CUDA)
        assert list(top_ids) == ids.tolist() or logits.log_softmax(-1).gather(1, got_ids).equal(values)
    graphs.release()


def test_a_call_inside_another_capture_is_recorded_eagerly_into_it():
    vocab = 1000
    graphs = LogprobGraphs(torch.zeros(16, vocab, device=CUDA))
    logits, tokens = _inputs(8, vocab, 3)
    outer = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        logprobs_of(logits, tokens, MAX_TOP_LOGPROBS)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(outer, stream=stream):
        got = graphs(logits, tokens, MAX_TOP_LOGPROBS)
    assert graphs.captured == [] and graphs.replays == 0 and got[3] is None
    fresh, fresh_tokens = _inputs(8, vocab, 4)
    logits.copy_(fresh)
    tokens.copy_(fresh_tokens)
    outer.replay()
    torch.cuda.synchronize()
    _assert_equals_eager(got, fresh, fresh_tokens, MAX_TOP_LOGPROBS)
    outer.reset()


def test_greedy_sampling_writes_its_tokens_into_the_static_rows_and_replays_without_a_copy():
    """A greedy batch whose logits are the static input's own rows: ``sample`` takes the argmax
    into the graphs' static token rows (``token_rows``), the call copies neither logits nor
    tokens, and its outputs equal eager ``logprobs_of``; other logits, or a sampled batch, still
    get a fresh token tensor."""
    from worker.sampling.params import SamplingParams
    from worker.sampling.sampler import SamplingBatch, sample

    vocab = 32000
    static = torch.zeros(64, vocab, device=CUDA)
    graphs = LogprobGraphs(static)
    for rows, width in ((64, MAX_TOP_LOGPROBS), (13, MAX_TOP_LOGPROBS), (13, 0), (40, MAX_TOP_LOGPROBS)):
        logits, _ = _inputs(rows, vocab, rows + width)
        static[:rows].copy_(logits)
        p = SamplingParams(temperature=0, logprobs=True, top_logprobs=width)
        batch = SamplingBatch.build([p] * rows, [0] * rows, [0] * rows, CUDA, vocab_size=vocab)
        out = sample(static[:rows], batch, logprob_graphs=graphs)
        expected_tokens = logits.argmax(-1)
        assert out.token_ids.data_ptr() == graphs.token_rows(static[:rows], width).data_ptr()
        assert torch.equal(out.token_ids, expected_tokens)
        _assert_equals_eager((out.logprobs, out.top_ids, out.top_logprobs, out.packed), logits, expected_tokens,
                             width)
    other, _ = _inputs(8, vocab, 7)  # not the static rows: no static token rows, still replayed
    assert graphs.token_rows(other, MAX_TOP_LOGPROBS) is None
    p = SamplingParams(temperature=0, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS)
    out = sample(other, SamplingBatch.build([p] * 8, [0] * 8, [0] * 8, CUDA, vocab_size=vocab), logprob_graphs=graphs)
    assert out.token_ids.data_ptr() != graphs.token_rows(static[:8], MAX_TOP_LOGPROBS).data_ptr()
    assert out.packed is not None
    _assert_equals_eager((out.logprobs, out.top_ids, out.top_logprobs, out.packed), other, other.argmax(-1),
                         MAX_TOP_LOGPROBS)
    graphs.release()
