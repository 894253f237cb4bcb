"""logit_bias in the sampler (CPU): +100 forces a token and -100 bans one, greedy rows included,
other rows' draws unchanged, log-probabilities unbiased, and an all-greedy batch stages only the
bias. (The sampler's no-sync checks with bias are in tests/test_sampling.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.test_sampling import CPU, run
from worker.sampling import SamplingParams
from worker.sampling.sampler import SamplingBatch, sample


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens_and_leaves_other_rows_alone(temperature):
    torch.manual_seed(3)
    logits = torch.randn(6, 300) * 3
    before = logits.clone()
    plain = [SamplingParams(temperature=temperature, logprobs=True) for _ in range(6)]
    top = logits.argmax(-1)
    biased = list(plain)
    biased[1] = SamplingParams(temperature=temperature, logprobs=True, logit_bias={7: 100})  # forces 7
    biased[3] = SamplingParams(temperature=temperature, logprobs=True,
                               logit_bias={int(top[3]): -100, 11: -100})  # bans row 3's favourite
    ref, got = run(logits, plain), run(logits, biased)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    assert got.token_ids[1] == 7 and got.token_ids[3] != top[3]
    others = [0, 2, 4, 5]
    assert torch.equal(got.token_ids[others], ref.token_ids[others])  # same seeds, same draws
    # Log-probabilities are the raw ones (unbiased), as vLLM reports by default.
    raw = logits.log_softmax(-1)
    assert torch.allclose(got.logprobs, raw.gather(1, got.token_ids[:, None]).squeeze(1), atol=1e-6)
    if temperature == 0:  # greedy with a ban: the next best token of the unbiased logits
        assert got.token_ids[3] == logits[3].topk(2).indices[1]


def test_a_biased_batch_with_every_row_greedy_stages_only_the_bias():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logit_bias={4: 100})] + [SamplingParams(temperature=0)] * 2
    batch = SamplingBatch.build(params, [0, 1, 2], [0, 0, 0], CPU)
    assert batch.all_greedy and batch.temperature is None and batch.bias is not None
    rows, tokens, values = batch.bias
    assert rows.tolist() == [0] and tokens.tolist() == [4] and values.tolist() == [100.0]
    out = sample(logits, batch)
    assert out.token_ids.tolist() == [4, *logits[1:].argmax(-1).tolist()]
