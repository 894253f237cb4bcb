"""SamplingParams: what a request's sampling parameters accept, refuse and normalise."""

from __future__ import annotations

import dataclasses

import pytest

from worker.sampling import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": True}, "max_tokens must be an int"),
    ({"max_tokens": 2.0}, "max_tokens must be an int"),
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": "1"}, "temperature must be a number"),
    ({"temperature": False}, "temperature must be a number"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"top_k": -2}, "top_k must be >= -1 (-1 or 0 disables top-k), got -2"),
    ({"top_k": True}, "top_k must be an int"),
    ({"top_k": 5.0}, "top_k must be an int"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01"),
    ({"min_p": float("-inf")}, "min_p must be a finite number"),
    ({"seed": 1.5}, "seed must be None or an int"),
    ({"seed": True}, "seed must be None or an int"),
    ({"seed": 1 << 64}, "seed must be in [-2**63, 2**64)"),
    ({"seed": -(1 << 63) - 1}, "seed must be in [-2**63, 2**64)"),
    ({"stop": ["a", ""]}, "stop[1] must be a non-empty string, got ''"),
    ({"stop": [3]}, "stop[0] must be a non-empty string, got 3"),
    ({"stop": 3}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[1] must be an int >= 0, got -1"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0] must be an int >= 0"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of ints"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ({"logprobs": "yes"}, "logprobs must be a bool"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"n": True}, "n must be an int"),
    ({"logit_bias": {5: 101}}, "logit_bias[5] must be in [-100, 100], got 101"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias[5] must be a finite number"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be an int >= 0, got -1"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias token id must be an int >= 0, got '5'"),
    ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias has token id 5 twice"),
    ({"logit_bias": [(5,)]}, "logit_bias entries must be (token id, bias) pairs"),
    ({"logit_bias": 5}, "logit_bias must be a dict of token id to bias"),
])
def test_params_validation(kwargs, message):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)


def test_params_normalisation_and_greedy():
    p = SamplingParams(temperature=1, top_p=1, min_p=0, stop=["a", "bc"], stop_token_ids=[2, 3],
                       seed=(1 << 64) - 1)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (2, 3)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop="###").stop == ("###",)
    hash(p)
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams().greedy
    assert SamplingParams(seed=7).effective_seed() == 7
    assert 0 <= SamplingParams().effective_seed() < 1 << 62
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0  # type: ignore[misc]


def test_logit_bias_is_normalised_to_sorted_pairs_and_hashable():
    p = SamplingParams(logit_bias={9: -100, 3: 2})
    assert p.logit_bias == ((3, 2.0), (9, -100.0))
    assert p == SamplingParams(logit_bias=[(9, -100.0), (3, 2.0)]) and hash(p) == hash(SamplingParams(
        logit_bias=((3, 2.0), (9, -100.0))))
