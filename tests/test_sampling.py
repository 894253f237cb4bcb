"""The batched device sampler (CPU; one CUDA-only host-sync test). SamplingParams: test_sampling_params.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from worker.sampling import SamplingParams
from worker.sampling.logprobs import fused_tail, top_k_rows
from worker.sampling.params import MAX_TOP_LOGPROBS
from worker.sampling.sampler import SampleOutput, SamplingBatch, _log_exponential, _row_keys, sample

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The tensors here are tiny: intra-op threads only add contention (and seconds) on a busy host."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(logits, params, seeds=None, steps=None, device=CPU, **kw) -> SampleOutput:
    n = len(params)
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    return sample(logits, SamplingBatch.build(params, seeds, steps, device, **kw))


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one seed and one step"):
        SamplingBatch.build([SamplingParams()], [1, 2], [0], CPU)
    with pytest.raises(ValueError, match="step"):
        SamplingBatch.build([SamplingParams()], [1], [-1], CPU)


# ---------------------------------------------------------------- the sampler

def test_greedy_is_argmax_and_top_k_1_matches():
    torch.manual_seed(0)
    logits = torch.randn(32, 500)
    out = run(logits, [SamplingParams(temperature=0)] * 32)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None
    for t in (0.3, 1.0, 5.0):
        out = run(logits, [SamplingParams(temperature=t, top_k=1)] * 32, seeds=list(range(100, 132)))
        assert torch.equal(out.token_ids, logits.argmax(-1))
    # Mixed batch: greedy rows still take the argmax of the raw logits.
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=3.0, top_p=0.9)
              for i in range(32)]
    out = run(logits, params)
    assert torch.equal(out.token_ids[1::2], logits.argmax(-1)[1::2])


def test_an_all_greedy_batch_stages_nothing_and_still_gives_logprobs():
    """A batch whose every row is greedy makes no device tensors (nothing to copy each step);
    its tokens are the argmax, its logprobs the raw log_softmax there, and a wrong row count is
    still refused."""
    torch.manual_seed(4)
    logits = torch.randn(6, 300, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0, logprobs=i % 2 == 0) for i in range(6)]
    batch = SamplingBatch.build(params, list(range(6)), [3] * 6, CPU)
    assert batch.all_greedy and batch.size == 6
    assert all(t is None for t in (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds,
                                   batch.steps, batch.greedy_mask))
    out = sample(logits, batch)
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    want = logits.float().log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, want, atol=1e-5)
    with pytest.raises(ValueError, match="logits must be"):
        sample(logits[:5], batch)
    with pytest.raises(ValueError, match="step must be an int"):
        SamplingBatch.build(params[:1], [1], [-2], CPU)


def test_logits_not_modified():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    copy = logits.clone()
    run(logits, [SamplingParams(top_k=5, top_p=0.5, min_p=0.1), SamplingParams(min_p=0.2),
                 SamplingParams(temperature=0.5), SamplingParams(temperature=0)])
    assert torch.equal(logits, copy)


CONFIGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(top_k=100, top_p=0.95, min_p=0.05),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0),
]


@pytest.mark.parametrize("target", CONFIGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_same_token_alone_and_in_batch(target):
    """The draw depends only on (logits row, params, seed, step): not on the batch or the row index."""
    torch.manual_seed(2)
    vocab = 3000
    row = torch.randn(vocab) * 2
    others = [CONFIGS[i % len(CONFIGS)] for i in range(15)] + [SamplingParams(top_k=5000)]
    for seed, step in [(123, 0), (123, 1), (-5, 17), ((1 << 64) - 1, 3)]:
        alone = run(row[None], [target], [seed], [step]).token_ids[0]
        for pos in (0, 9, 15):
            params = others[:pos] + [target] + others[pos:]
            logits = torch.randn(len(params), vocab) * 2
            logits[pos] = row
            seeds = [1000 + i for i in range(len(params))]
            steps = [i * 3 for i in range(len(params))]
            seeds[pos], steps[pos] = seed, step
            assert run(logits, params, seeds, steps).token_ids[pos] == alone
        # A padded vocabulary (extra -inf columns) does not change the draw either.
        padded = torch.cat([row, torch.full((64,), -math.inf)])[None]
        assert run(padded, [target], [seed], [step]).token_ids[0] == alone


def test_different_seeds_and_steps_give_different_draws():
    vocab = 1000
    logits = torch.zeros(200, vocab)
    p = [SamplingParams()] * 200
    by_seed = run(logits, p, seeds=list(range(200))).token_ids
    by_step = run(logits, p, seeds=[42] * 200, steps=list(range(200))).token_ids
    # 200 uniform draws over 1000 tokens: ~182 distinct expected.
    assert len(set(by_seed.tolist())) > 160
    assert len(set(by_step.tolist())) > 160
    assert (by_seed != by_step).sum() > 180
    # Seeds that differ only in the high 32 bits are different streams too.
    hi = run(logits, p, seeds=[(i << 32) + 5 for i in range(200)]).token_ids
    assert len(set(hi.tolist())) > 160


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert torch.all(counts[expected == 0] == 0)
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("vary", ["step", "seed"])
def test_empirical_distribution_matches_softmax(vary):
    n, temp = 20000, 0.7
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.8])
    seeds = [7] * n if vary == "step" else list(range(n))
    steps = list(range(n)) if vary == "step" else [5] * n
    out = run(logits.expand(n, -1), [SamplingParams(temperature=temp)] * n, seeds, steps)
    probs = torch.softmax(logits.double() / temp, -1)
    # df = 7; P(chi2 > 40) ~ 1e-6.
    assert _chi_square(out.token_ids, probs) < 40
    freq = torch.bincount(out.token_ids, minlength=8).double() / n
    assert (freq - probs).abs().max() < 0.015


def test_filtered_distribution_is_renormalised():
    n = 20000
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.8])
    probs = torch.softmax(logits.double(), -1)
    cases = [
        # top_k=4 keeps tokens 3, 6, 0, 7.
        (SamplingParams(top_k=4), [3, 6, 0, 7]),
        # sorted probs .384 .172 .141 .116 .086 ...: mass before token 7 is .697 < .75, before 1 .813.
        (SamplingParams(top_p=0.75), [3, 6, 0, 7]),
        # min_p=0.3 keeps tokens with logit >= 2 + ln(0.3) = 0.796.
        (SamplingParams(min_p=0.3), [3, 6, 0, 7]),
        # top-p sees the top-5 renormalised: mass before token 7 is .697 / .898 = .776 >= .74.
        (SamplingParams(top_k=5, top_p=0.74, min_p=0.01), [3, 6, 0]),
    ]
    for params, kept in cases:
        out = run(logits.expand(n, -1), [params] * n, [11] * n, list(range(n)))
        expected = torch.zeros(8, dtype=torch.float64)
        expected[kept] = probs[kept] / probs[kept].sum()
        assert _chi_square(out.token_ids, expected) < 40, params


@st.composite
def batches(draw):
    vocab = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 5))
    value = st.floats(-12, 12, allow_nan=False, width=32)
    logits = [draw(st.lists(st.one_of(value, st.sampled_from([0.0, 1.0])), min_size=vocab, max_size=vocab))
              for _ in range(rows)]
    params = [SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 4.0))),
        top_k=draw(st.integers(-1, vocab + 2)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(1e-3, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    ) for _ in range(rows)]
    seeds = draw(st.lists(st.integers(-(1 << 63), (1 << 64) - 1), min_size=rows, max_size=rows))
    steps = draw(st.lists(st.integers(0, 1 << 40), min_size=rows, max_size=rows))
    vocab_size = draw(st.sampled_from([None, vocab]))
    return torch.tensor(logits, dtype=torch.float32), params, seeds, steps, vocab_size


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_filters_never_emit_excluded_tokens(case):
    logits, params, seeds, steps, vocab_size = case
    out = run(logits, params, seeds, steps, vocab_size=vocab_size)
    for row, p, tok in zip(logits, params, out.token_ids.tolist(), strict=True):
        assert 0 <= tok < row.numel()
        if p.greedy:
            assert tok == int(row.argmax())
            continue
        s = row / torch.tensor(p.temperature, dtype=torch.float32)  # the sampler's float32 scaling
        s64 = s.double()
        greater = s > s[tok]
        if p.top_k > 0:
            assert int(greater.sum()) < p.top_k
        # Renormalise over the top-k values (tie-independent), then check the mass ranked above tok.
        k = p.top_k if 0 < p.top_k < row.numel() else row.numel()
        z = torch.exp(s64 - s64.max())
        z_top = z.sort(descending=True).values[:k].sum()
        if p.top_p < 1:
            assert float(z[greater].sum() / z_top) < p.top_p + 1e-5
        assert float(z[tok]) >= p.min_p * (1 - 1e-5) - 1e-12


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(6, 300) * 3
    params = [SamplingParams(temperature=0.5, top_k=10, logprobs=True), SamplingParams(temperature=0),
              SamplingParams(top_p=0.3), SamplingParams(min_p=0.5), SamplingParams(), SamplingParams(temperature=2)]
    out = run(logits, params)
    want = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, logprobs=True),
                                    SamplingParams(logprobs=True),
                                    SamplingParams(top_k=7, top_p=0.9, logprobs=True)])
def test_half_precision_logits(params):
    torch.manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(8, 1000) * 4).to(dtype)
        out = run(logits, [params] * 8)
        ref = run(logits.float(), [params] * 8)
        assert torch.equal(out.token_ids, ref.token_ids)
        assert out.logprobs.dtype == torch.float32
        torch.testing.assert_close(out.logprobs, ref.logprobs)
        if params.greedy:
            assert torch.equal(out.token_ids, logits.float().argmax(-1))


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_unbounded_integer_reference():
    """The int64 tensor hash equals exact arithmetic, i.e. no int64 overflow for any seed/step."""
    from worker.sampling import sampler

    seeds = [0, 1, -1, -(1 << 63), (1 << 63) - 1, 0x123456789ABCDEF, -987654321]
    steps = [0, 1, 5, (1 << 63) - 1, 1 << 32, 77, 3]
    keys = _row_keys(torch.tensor(seeds), torch.tensor(steps))
    tokens = torch.tensor([[0, 1, 2, 151935, (1 << 31) + 5]])
    log_e = _log_exponential(keys, tokens)
    for i, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        u64, v64 = seed % (1 << 64), step % (1 << 64)
        k = _lowbias32((u64 & 0xFFFFFFFF) ^ sampler._SEED_SALT)
        for part in (u64 >> 32, v64 & 0xFFFFFFFF, v64 >> 32):
            k = _lowbias32(k ^ part)
        assert int(keys[i]) == k
        for j, tok in enumerate(tokens[0].tolist()):
            x = _lowbias32(_lowbias32((tok + sampler._TOKEN_SALT) & 0xFFFFFFFF) ^ k)
            u = min((x + 0.5) / 2 ** 32, 1 - 2 ** -24)
            assert math.isclose(float(log_e[i, j]), math.log(-math.log1p(-u)), rel_tol=1e-4, abs_tol=1e-4)


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bool_index = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops.append(name)
        if name in ("index", "index_put", "index_put_"):
            idx = args[1] if len(args) > 1 else []
            self.bool_index |= any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx if t is not None)
        return func(*args, **(kwargs or {}))


_SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "multinomial",
                "unique", "_unique", "_unique2", "unique_consecutive", "masked_scatter"}


@pytest.mark.parametrize("params, sorts", [
    ([SamplingParams(), SamplingParams(temperature=0.5, min_p=0.1)], set()),
    ([SamplingParams(temperature=0)] * 2, set()),
    ([SamplingParams(top_k=50), SamplingParams(top_k=20, top_p=0.9, min_p=0.1)], {"topk"}),
    ([SamplingParams(top_p=0.9), SamplingParams(temperature=0, logprobs=True)], {"sort"}),
    ([SamplingParams(top_k=50), SamplingParams()], {"sort"}),
    ([SamplingParams(logit_bias={3: 5.0}), SamplingParams(temperature=0, logit_bias={7: -100})], set()),
])
def test_sample_has_no_sync_ops_and_sorts_only_when_needed(params, sorts):
    """CPU stand-in for the CUDA check below: no op that reads device data back or has a data-dependent shape."""
    logits = torch.randn(len(params), 1000)
    batch = SamplingBatch.build(params, [1] * len(params), [0] * len(params), CPU)
    with _OpRecorder() as rec:
        sample(logits, batch)
    ops = set(rec.ops)
    assert not ops & _SYNCING_OPS, ops & _SYNCING_OPS
    assert not rec.bool_index
    assert ops & {"sort", "topk"} == sorts


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    params = [SamplingParams(), SamplingParams(temperature=0, logprobs=True), SamplingParams(top_k=40),
              SamplingParams(top_p=0.9, min_p=0.05), SamplingParams(min_p=0.1),
              SamplingParams(temperature=0, logit_bias={5: 100, 9: -100})]
    logits = torch.randn(len(params), 152064, device=dev, dtype=torch.bfloat16)
    for width, dtype in itertools.product((0, MAX_TOP_LOGPROBS), (torch.float32, logits.dtype)):
        fused_tail(dev, logits.shape[1], width, dtype)  # as a model runner does at start: a probe synchronises
    for group in (params, params[:1], params[1:2], params[2:3], params[4:5], params[5:]):
        batch = SamplingBatch.build(group, list(range(len(group))), [3] * len(group), dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = sample(logits[:len(group)], batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        tokens = out.token_ids.cpu()
        assert tokens.shape == (len(group),) and bool(((tokens >= 0) & (tokens < logits.shape[1])).all())
        for i, p in enumerate(group):
            if p.greedy and not p.logit_bias:
                assert tokens[i] == logits[i].float().argmax().cpu()
            elif p.logit_bias:
                assert tokens[i] == 5


def test_rows_kept_for_the_same_batch_equal_rows_built_afresh():
    """SamplingRows reuses the host side while the batch is the same params objects in the same
    order; any change of composition (a row joins, leaves, or moves) builds it afresh."""
    from worker.sampling.sampler import SamplingRows

    def fields(b):
        return ([None if t is None else t.tolist()
                 for t in (b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps, b.greedy_mask)],
                (b.all_greedy, b.any_greedy, b.needs_sort, b.needs_top_p, b.needs_min_p, b.topk_width,
                 b.want_logprobs))

    a = SamplingParams(temperature=0.7, top_k=5)
    b = SamplingParams(temperature=0.0, logprobs=True)
    c = SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05)
    rows = SamplingRows()
    batches = [[a, b, c], [a, b, c], [a, c], [c, a], [c, a, b], [b, b], [b], [SamplingParams(temperature=0.7, top_k=5)],
               []]
    for step, params in enumerate(batches):
        seeds, steps = [7 + i for i in range(len(params))], [step] * len(params)
        kept = SamplingBatch.build(params, seeds, steps, CPU, rows=rows)
        fresh = SamplingBatch.build(params, seeds, steps, CPU)
        assert fields(kept) == fields(fresh), step
    with pytest.raises(ValueError, match="step must be an int"):
        SamplingBatch.build([a], [1], [True], CPU, rows=rows)
    with pytest.raises(ValueError, match="seed must be an int"):
        SamplingBatch.build([a], [1.5], [0], CPU, rows=rows)


@pytest.mark.parametrize("vocab", [32000, 32001, 128256, 1000])
def test_top_k_rows_equals_topk_values_with_ties_and_infinities(vocab):
    """The chunked top-k returns ``topk``'s values (ids: entries holding them, no repeats), also
    when equal values straddle chunks, a row is mostly -inf, or the top entries share one chunk."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = torch.round(x[1] * 2)  # few distinct values: ties everywhere, also at the k-th value
    x[2] = -math.inf
    x[2, vocab - 1] = 0.0  # the last (possibly padded) chunk holds the only finite entry
    x[3, 300:340] = 9.0  # more entries equal to the maximum than k, inside three chunks
    for k in (1, 7, 20):
        values, ids = top_k_rows(x, k)
        assert torch.equal(values, x.topk(k, dim=-1, sorted=True).values)
        assert torch.equal(x.gather(1, ids), values)
        assert all(len(set(row)) == k for row in ids.tolist())
