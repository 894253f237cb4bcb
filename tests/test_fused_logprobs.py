"""worker.sampling.fused_logprobs in Triton's interpreter (CPU; tests/conftest.py switches it on):
the chosen token's log-probability, the top ``width`` and the packed rows equal the torch path
(:func:`worker.sampling.logprobs.torch_logprobs_of` and :func:`~worker.sampling.packed_rows.pack`)
across chunk layouts, a partial last chunk, ties, -inf entries, bf16 and strided inputs; bad
inputs get errors that name them. Small chunks keep the interpreter's sorts quick; the GPU module
runs the default chunks at real vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

from worker.sampling.fused_logprobs import chunk_width, logprob_tail
from worker.sampling.logprobs import torch_logprobs_of
from worker.sampling.packed_rows import pack

ATOL = 4e-6  # float32 rounding of a differently ordered log-sum-exp, logits of scale ~4


def _inputs(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    return logits, torch.randint(0, vocab, (rows,), generator=g)


def _assert_matches_torch(got, logits, tokens, width):
    chosen, ids, values = torch_logprobs_of(logits.float(), tokens, width)
    torch.testing.assert_close(got[0], chosen, atol=ATOL, rtol=0)
    if not width:
        assert got[1] is None and got[2] is None
    else:
        torch.testing.assert_close(got[2], values, atol=ATOL, rtol=0)
        # float32 normals have no ties: the same ids in the same order; bf16 ones tie, and ties
        # come lower id first (torch's topk promises no order): ids that hold the same values
        assert torch.equal(got[1], ids) or (logits.dtype != torch.float32 and torch.equal(
            logits.float().log_softmax(-1).gather(1, got[1]), values))
    assert torch.equal(got[3], pack(tokens, got[0], got[1], got[2]))


@pytest.mark.parametrize("rows,vocab,width,chunk", [
    (3, 1000, 20, 64),  # 16 chunks (fewer than the width: all searched), the last partial
    (2, 3000, 5, 32),  # 94 chunks, the 5 with the largest maxima searched
    (4, 257, 0, 64),  # no alternatives: only the log-sum-exp and the chosen token
    (1, 20, 20, 32),  # width = vocabulary, one partial chunk
    (2, 4096, 1, 4),  # 1024 chunks (the most a row has), one candidate
    (2, 64, 1, 64),  # one full chunk
])
def test_equals_the_torch_path(rows, vocab, width, chunk):
    logits, tokens = _inputs(rows, vocab, seed=rows * vocab + width)
    _assert_matches_torch(logprob_tail(logits, tokens, width, chunk=chunk), logits, tokens, width)


def test_bf16_strided_rows_and_int32_tokens():
    wide, tokens = _inputs(3, 700, seed=1, dtype=torch.bfloat16)
    logits = wide[:, :500]  # row stride 700, columns contiguous
    got = logprob_tail(logits, tokens.remainder(500).to(torch.int32), 8, chunk=64)
    _assert_matches_torch(got, logits, tokens.remainder(500), 8)


def test_ties_come_lower_id_first_and_minus_inf_last():
    logits = torch.full((2, 200), -math.inf)
    logits[0, [7, 150, 3, 90]] = torch.tensor([2.0, 2.0, 1.0, 2.0])  # three equal maxima in three chunks
    logits[1] = torch.arange(200.0).flip(0) / 50
    logits[1, 100:] = -math.inf
    tokens = torch.tensor([150, 199])
    chosen, ids, values, _ = logprob_tail(logits, tokens, 6, chunk=32)
    lse = math.log(3 * math.exp(2.0) + math.exp(1.0))
    assert ids[0, :4].tolist() == [7, 90, 150, 3]
    torch.testing.assert_close(values[0, :4], torch.tensor([2 - lse] * 3 + [1 - lse]), atol=ATOL, rtol=0)
    assert values[0, 4:].tolist() == [-math.inf, -math.inf]
    assert set(ids[0, 4:].tolist()) <= set(range(200)) - {7, 90, 150, 3}
    assert ids[1].tolist() == list(range(6))
    assert chosen[1].item() == -math.inf
    torch.testing.assert_close(chosen[0], torch.tensor(2 - lse), atol=ATOL, rtol=0)


def test_a_flat_row_gives_the_lowest_ids():
    chosen, ids, values, _ = logprob_tail(torch.zeros(1, 1000), torch.tensor([999]), 20, chunk=32)
    assert ids[0].tolist() == list(range(20))
    torch.testing.assert_close(values[0], torch.full((20,), -math.log(1000)), atol=ATOL, rtol=0)
    torch.testing.assert_close(chosen[0], torch.tensor(-math.log(1000)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_heavy_ties_keep_the_values_and_distinct_ids(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (3, 700), generator=g).float()  # four distinct values: ties everywhere
    tokens = torch.randint(0, 700, (3,), generator=g)
    chosen, ids, values, _ = logprob_tail(logits, tokens, 20, chunk=16)
    ref_chosen, _, ref_values = torch_logprobs_of(logits, tokens, 20)
    torch.testing.assert_close(values, ref_values, atol=ATOL, rtol=0)
    torch.testing.assert_close(chosen, ref_chosen, atol=ATOL, rtol=0)
    assert torch.equal(logits.log_softmax(-1).gather(1, ids), ref_values)
    assert all(len(set(r)) == 20 for r in ids.tolist())
    for r, row in enumerate(ids.tolist()):  # ties come lower id first within each value
        for a, b in zip(row, row[1:]):
            assert logits[r, a] > logits[r, b] or a < b


def test_no_rows():
    chosen, ids, values, packed = logprob_tail(torch.zeros(0, 100), torch.zeros(0, dtype=torch.int64), 4, chunk=32)
    assert chosen.shape == (0,) and ids.shape == values.shape == (0, 4) and packed.shape == (0, 10)


def test_default_chunks_cut_a_row_into_at_most_1024():
    assert chunk_width(32000) == 32
    assert chunk_width(128256) == 128
    for vocab in (20, 1000, 32000, 32768, 128256, 151936):
        chunk = chunk_width(vocab)
        assert -(-vocab // chunk) <= 1024 and (chunk == 32 or -(-vocab // (chunk // 2)) > 1024)


@pytest.mark.parametrize("call,message", [
    (lambda x, t: logprob_tail(x, t, 101), "width must be in"),
    (lambda x, t: logprob_tail(x.t(), t, 4), "contiguous columns"),
    (lambda x, t: logprob_tail(x.long(), t, 4), "floating"),
    (lambda x, t: logprob_tail(x, t[:2], 4), "tokens must be"),
    (lambda x, t: logprob_tail(x, t.float(), 4), "tokens must be"),
    (lambda x, t: logprob_tail(x, t, 65), "width must be in"),
    (lambda x, t: logprob_tail(x, t, 4, chunk=48), "chunk must be a power of two"),
    (lambda x, t: logprob_tail(torch.zeros(3, 5000), t, 4, chunk=4), "at most 1024 chunks"),
])
def test_bad_inputs_are_named(call, message):
    logits, tokens = _inputs(3, 100, seed=5)
    with pytest.raises(ValueError, match=message):
        call(logits, tokens)


def test_the_probe_passes_the_kernels_and_fails_a_broken_or_wrong_one(caplog):
    """``probe_fused_tail`` (what a model runner runs at start, per device and kernel variant): the
    kernels pass (here in Triton's interpreter) for float32 and bf16 logits, widths 0 and 20; a
    kernel that raises (a compile error on some GPU), answers wrongly, or packs its rows wrongly
    fails with a warning naming why, so ``fused_tail`` leaves that variant to the torch ops."""
    from worker.sampling.logprobs import probe_fused_tail

    cpu = torch.device("cpu")
    for vocab, width, dtype in ((1000, 5, torch.float32), (3000, 20, torch.bfloat16), (300, 0, torch.float32)):
        assert probe_fused_tail(logprob_tail, cpu, vocab, width, dtype)

    def broken(logits, tokens, width):
        raise RuntimeError("PassManager::run failed")  # what a Triton compile error says

    def shifted(logits, tokens, width):
        chosen, ids, values = torch_logprobs_of(logits, tokens, width)
        return chosen + 1e-2, ids, values, pack(tokens, chosen + 1e-2, ids, values)

    def misplaced(logits, tokens, width):
        chosen, ids, values, packed = logprob_tail(logits, tokens, width)
        return chosen, ids, values, packed.flip(0)

    with caplog.at_level("WARNING", logger="worker.sampling.logprobs"):
        assert not probe_fused_tail(broken, cpu)
        assert not probe_fused_tail(shifted, cpu)
        assert not probe_fused_tail(misplaced, cpu)
    assert "unusable on cpu for 1000 columns" in caplog.text and "PassManager::run failed" in caplog.text
    assert caplog.text.count("disagree with the torch ops on cpu") == 2


def test_fused_tail_answers_per_variant_and_none_for_one_whose_probe_failed():
    from worker.sampling import logprobs

    cpu = torch.device("cpu")
    key = (cpu, 1000, 20, torch.float32)
    logprobs._probed.pop(key, None)
    try:
        assert logprobs.fused_tail(cpu, 1000, 20) is logprob_tail  # probed here (the interpreter passes)
        assert logprobs._probed[key] is True
        logprobs._probed[key] = False
        assert logprobs.fused_tail(cpu, 1000, 20) is None
        assert logprobs.fused_tail(cpu, 1000, 0) is logprob_tail  # another variant: probed on its own
    finally:
        for k in [k for k in logprobs._probed if k[0] == cpu]:
            del logprobs._probed[k]
