"""Presence, frequency and repetition penalties (issue 19 item 2), on CPU: the device update equals
the reference formula (vLLM's) row by row, an in-flight token counts from the step's input ids, and
the engine's greedy output under penalties is the one HF transformers' float32 logits give with the
formula applied at every step, with synchronous and with async scheduling."""

from __future__ import annotations

import pytest
import torch

from deploy.config import load_config
from tests.reference import hf_logits
from tests.serve_harness import OVERRIDES
from tests.test_sampling import CPU, run
from worker.engine import Engine
from worker.sampling.params import SamplingParams, SamplingParamsError
from worker.sampling.penalties import PenaltyHistory
from worker.sampling.sampler import SamplingBatch, sample

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 301, 44, 9, 260, 71, 17, 17]


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The reference: one row's logits after ``p``'s penalties, token by token."""
    out = logits.clone().double()
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out.float()


def test_bad_penalties_are_refused_naming_the_field():
    for fields, message in (({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
                            ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
                            ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 100\], got 0.0"),
                            ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
                            ({"presence_penalty": True}, "presence_penalty must be a number, got bool")):
        with pytest.raises(SamplingParamsError, match=message):
            SamplingParams(**fields)


def test_the_device_update_equals_the_formula_row_by_row_with_an_in_flight_token():
    torch.manual_seed(5)
    vocab = 64
    logits = torch.randn(4, vocab) * 3
    params = [SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(temperature=0),  # no penalty: untouched
              SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=-0.4),
              SamplingParams(temperature=0.7, repetition_penalty=0.6, presence_penalty=-1.0, seed=3)]
    prompts = [[1, 2], [3], [4, 4, 9, 10], [11, 12, 13]]
    known = [[7, 7, 9], [8], [9, 9, 30, 2], []]
    in_flight = {0: 7, 3: 12}  # the last output of rows 0 and 3 is still on the device: their input ids
    input_ids = torch.tensor([0, 0, 0, 7, 0, 0, 12])  # rows 0 and 3 sample at input positions 3 and 6
    rows = [0, 2, 3]
    history = PenaltyHistory.of(
        (rows, [r for r in rows for _ in known[r]], [t for r in rows for t in known[r]],
         [r for r in rows if params[r].repetition_penalty != 1 for _ in sorted(set(prompts[r]))],
         [t for r in rows if params[r].repetition_penalty != 1 for t in sorted(set(prompts[r]))]),
        [3, 4, 5, 6], [(3, 0), (6, 1)])
    batch = SamplingBatch.build(params, [0, 1, 2, 3], [3, 1, 4, 1], CPU, history=history, input_ids=input_ids)
    assert batch.penalties is not None and batch.penalties.inflight_tokens.tolist() == [7, 12]
    want = torch.stack([penalized(logits[r], prompts[r], known[r] + ([in_flight[r]] if r in in_flight else []),
                                  params[r]) for r in range(4)])
    assert torch.equal(want[1], logits[1])
    out = sample(logits, batch)
    assert torch.equal(out.token_ids[:3], want[:3].argmax(-1))
    assert torch.equal(sample(want[3:], SamplingBatch.build([params[3]], [3], [1], CPU)).token_ids, out.token_ids[3:])
    with pytest.raises(ValueError, match="pass the step's input_ids"):
        SamplingBatch.build(params, [0, 1, 2, 3], [3, 1, 4, 1], CPU, history=history)


def test_a_penalized_batch_keeps_raw_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(2, 40)
    p = SamplingParams(temperature=0, logprobs=True, presence_penalty=2.0, repetition_penalty=3.0)
    out = run(logits, [p, p], history=PenaltyHistory.of(([0, 1], [0, 1], [int(logits[0].argmax()), 5], [], []),
                                                        [0, 1], []))
    raw = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, raw)
    assert out.token_ids[0] != logits[0].argmax()  # the repeated favourite lost its place


def hf_penalized_greedy(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    """HF's float32 greedy tokens with ``p``'s penalties applied by the reference at every step."""
    output: list[int] = []
    for _ in range(p.max_tokens):
        logits = hf_logits(hf, prompt + output)[-1]
        output.append(int(penalized(logits, prompt, output, p).argmax()))
    return output


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_greedy_output_under_penalties_is_the_formulas(checkpoint_dir, async_scheduling):
    path = checkpoint_dir("tiny-llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    engine = Engine(load_config(None, [f"model.path={path}", *OVERRIDES,
                                       f"scheduler.async_scheduling={str(async_scheduling).lower()}"]))
    base = dict(max_tokens=12, temperature=0, ignore_eos=True)
    params = [SamplingParams(**base, presence_penalty=1.2, frequency_penalty=0.8),
              SamplingParams(**base, repetition_penalty=1.8),
              SamplingParams(**base, frequency_penalty=2.0, repetition_penalty=1.3),
              SamplingParams(**base)]
    outs = engine.generate([PROMPT, PROMPT[:5], PROMPT[2:], PROMPT], params)
    plain = outs[3].token_ids
    assert plain == hf_penalized_greedy(hf, PROMPT, params[3])
    for out, p in zip(outs[:3], params):
        assert out.token_ids == hf_penalized_greedy(hf, out.prompt_token_ids, p), p
    assert outs[0].token_ids != plain  # the penalties changed the output (else this test shows nothing)
