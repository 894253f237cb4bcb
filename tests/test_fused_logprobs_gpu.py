"""worker.sampling.fused_logprobs compiled on the GPU: equal to the torch path at real vocabularies
(32k, 128k), small ones, widths 0, 1 and 20, float32 and bf16 logits, strided rows; and replayed
from a CUDA graph over static buffers, equal to a direct call; heavy ties keep the values."""

from __future__ import annotations

import pytest
import torch

from worker.sampling.fused_logprobs import logprob_tail
from worker.sampling.logprobs import torch_logprobs_of
from worker.sampling.packed_rows import pack
from worker.sampling.params import MAX_TOP_LOGPROBS

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ATOL = 5e-5  # float32 log-sum-exp over 128k entries, summed in another order with the GPU's exp


def _inputs(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    logits = (torch.randn(rows, vocab, device=CUDA, generator=g) * 4).to(dtype)
    return logits, torch.randint(0, vocab, (rows,), device=CUDA, generator=g)


def _assert_matches_torch(got, logits, tokens, width):
    chosen, ids, values = torch_logprobs_of(logits.float(), tokens, width)
    torch.testing.assert_close(got[0], chosen, atol=ATOL, rtol=0)
    if width:
        torch.testing.assert_close(got[2], values, atol=ATOL, rtol=0)
        assert torch.equal(got[1], ids) or (logits.dtype != torch.float32 and torch.equal(
            logits.float().log_softmax(-1).gather(1, got[1]), values))
    else:
        assert got[1] is None and got[2] is None
    assert torch.equal(got[3], pack(tokens, got[0], got[1], got[2]))


@pytest.mark.parametrize("vocab", [32000, 128256, 1000, 50])
@pytest.mark.parametrize("width", [0, 1, MAX_TOP_LOGPROBS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_torch_path(vocab, width, dtype):
    for rows in (1, 64, 256):
        logits, tokens = _inputs(rows, vocab, seed=rows + width, dtype=dtype)
        _assert_matches_torch(logprob_tail(logits, tokens, min(width, vocab)), logits, tokens, min(width, vocab))


def test_strided_rows_of_a_static_buffer():
    static = torch.zeros(256, 32000 + 64, device=CUDA)
    logits, tokens = _inputs(40, 32000, seed=3)
    static[:40, :32000] = logits
    _assert_matches_torch(logprob_tail(static[:40, :32000], tokens, MAX_TOP_LOGPROBS), logits, tokens,
                          MAX_TOP_LOGPROBS)


@pytest.mark.parametrize("width", [0, MAX_TOP_LOGPROBS])
def test_a_graph_replay_equals_a_direct_call(width):
    static_logits = torch.zeros(64, 32000, device=CUDA)
    static_tokens = torch.zeros(64, dtype=torch.int64, device=CUDA)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        logprob_tail(static_logits, static_tokens, width)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = logprob_tail(static_logits, static_tokens, width)
    for seed in (1, 2):
        logits, tokens = _inputs(64, 32000, seed=seed)
        static_logits.copy_(logits)
        static_tokens.copy_(tokens)
        graph.replay()
        direct = logprob_tail(logits, tokens, width)
        for replayed, want in zip(outputs, direct):
            assert (replayed is None and want is None) or torch.equal(replayed, want)
    graph.reset()


def test_heavy_ties_keep_the_values_and_distinct_ids():
    g = torch.Generator(device=CUDA).manual_seed(7)
    logits = torch.randint(0, 4, (64, 32000), device=CUDA, generator=g).float()
    logits[0] = 0.0  # a flat row: the lowest ids
    tokens = torch.randint(0, 32000, (64,), device=CUDA, generator=g)
    chosen, ids, values, _ = logprob_tail(logits, tokens, MAX_TOP_LOGPROBS)
    ref_chosen, _, ref_values = torch_logprobs_of(logits, tokens, MAX_TOP_LOGPROBS)
    torch.testing.assert_close(values, ref_values, atol=ATOL, rtol=0)
    torch.testing.assert_close(chosen, ref_chosen, atol=ATOL, rtol=0)
    assert torch.equal(logits.log_softmax(-1).gather(1, ids), ref_values)
    assert all(len(set(r)) == MAX_TOP_LOGPROBS for r in ids.tolist())
    assert ids[0].tolist() == list(range(MAX_TOP_LOGPROBS))


def test_the_kernels_pass_their_probe_on_the_gpu():
    """What a ModelRunner asks at start: the served variants compile and agree with the torch ops here."""
    from worker.sampling.logprobs import fused_tail, probe_fused_tail

    for vocab in (32000, 128256):
        for width in (0, MAX_TOP_LOGPROBS):
            assert probe_fused_tail(logprob_tail, CUDA, vocab, width)
            assert fused_tail(CUDA, vocab, width) is logprob_tail
    assert probe_fused_tail(logprob_tail, CUDA, 32000, MAX_TOP_LOGPROBS, torch.bfloat16)
