"""Log-probabilities and penalties on the GPU: with decode graphs (async scheduling, the default;
log-probabilities replayed from their own graphs) they equal the engine's with graphs off, in bf16,
for greedy and seeded sampled rows that ask for the chosen token's log-probability, for the top 20,
for penalties, or for nothing, in one batch."""

from __future__ import annotations

import pytest
import torch

from deploy.config import load_config
from worker.engine import Engine
from worker.sampling.params import MAX_TOP_LOGPROBS, SamplingParams

pytestmark = pytest.mark.gpu
ATOL = 0.05  # bf16 logits of a padded graph batch against the eager batch's: a few bf16 ulps


def _engine(path, graphs: bool) -> Engine:
    return Engine(load_config(None, [f"model.path={path}", "cache.num_pages=1024", "scheduler.max_running_requests=16",
                                     "graphs.decode.max_batch_size=16", f"graphs.enabled={str(graphs).lower()}"]))


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.timeout(600)
def test_logprobs_with_decode_graphs_equal_graphs_off(checkpoint_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = checkpoint_dir("tiny-llama")
    asks = [{}, {"logprobs": True}, {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS},
            {"logprobs": True, "top_logprobs": 3},
            {"logprobs": True, "presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.4}]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if k % 2 else 0.9, seed=k, ignore_eos=True,
                             **asks[k % len(asks)]) for k in range(15)]
    prompts = [list(range(10, 14 + 7 * k)) for k in range(15)]
    eager = _engine(path, graphs=False).generate(prompts, params)
    graphs = _engine(path, graphs=True)
    got = graphs.generate(prompts, params)
    assert any(s.phase == "decode" for s in graphs.step_stats)
    assert graphs.worker.runner.logprob_graphs.replays > 0  # the log-probabilities replayed from graphs
    compared = 0
    for k, (g, e, p) in enumerate(zip(got, eager, params)):
        n = _agreeing_prefix(g.token_ids, e.token_ids)
        assert n >= 8, f"request {k}: graphs and eager part after {n} tokens"
        if not p.logprobs:
            assert g.logprobs is None and e.logprobs is None
            continue
        for i in range(n + 1 if n < len(g.token_ids) else n):  # the first differing token's log-probs too
            (glp, gids, gvals), (elp, eids, evals) = ((x, [], []) if not isinstance(x, tuple) else x
                                                      for x in (g.logprobs[i], e.logprobs[i]))
            if i < n:
                assert glp == pytest.approx(elp, abs=ATOL), f"request {k}, token {i}"
            assert len(gids) == len(eids) == p.top_logprobs
            assert gvals == pytest.approx(evals, abs=ATOL)
            # ids agree wherever the eager values leave a gap wider than the tolerance
            for j, (gid, eid) in enumerate(zip(gids, eids)):
                gap = min((abs(evals[j] - evals[m]) for m in (j - 1, j + 1) if 0 <= m < len(evals)), default=1.0)
                assert gid == eid or gap <= 2 * ATOL, f"request {k}, token {i}, rank {j}"
            compared += 1
    assert compared >= 100


@pytest.mark.timeout(300)
def test_prompt_logprobs_with_prefill_graphs_equal_graphs_off(checkpoint_dir):
    """A prefill step with prompt log-probabilities runs eagerly (every position's hidden state is
    needed) beside graph-replayed steps, over several chunks; its values equal graphs off."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = checkpoint_dir("tiny-llama")
    prompts = [[(7 * i + k) % 900 + 5 for i in range(300 + 40 * k)] for k in range(4)]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=[None, 0, 5, 20][k])
              for k in range(4)]

    def engine(graphs: bool) -> Engine:
        overrides = ["cache.num_pages=1024", "scheduler.chunked_prefill_size=256",
                     f"graphs.enabled={str(graphs).lower()}"]
        return Engine(load_config(None, [f"model.path={path}", *overrides]))

    eager, got = engine(False).generate(prompts, params), engine(True).generate(prompts, params)
    for g, e, p, ids in zip(got, eager, params, prompts):
        if p.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert len(g.prompt_logprobs) == len(e.prompt_logprobs) == len(ids) - 1
        assert [lp for lp, _, _ in g.prompt_logprobs] == pytest.approx([lp for lp, _, _ in e.prompt_logprobs], abs=ATOL)
        assert all(len(i) == p.prompt_logprobs for _, i, _ in g.prompt_logprobs)
