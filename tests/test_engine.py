"""The eager engine: chunked prefill, continuous batching, preemption, aborts, admission errors."""

from __future__ import annotations

import random

import pytest
import torch

from deploy.config import load_config
from tests.reference import OwnModel, rel_err
from worker.admission import (
    EmptyPrompt,
    NoTokenizer,
    PromptLimits,
    PromptTooLong,
    TokenOutsideVocabulary,
    encode_prompt,
)
from worker.engine import Engine
from worker.request import RequestRejected
from worker.sampling.params import SamplingParams, SamplingParamsError


def make_engine(path, *overrides: str) -> Engine:
    return Engine(load_config(None, [f"model.path={path}", *overrides]))


def test_chunked_prefill_logits_equal_unchunked(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    prompt = torch.randint(3, 1024, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = OwnModel(path)
    ref = whole.step([whole.new_request(prompt, 0)], [300], is_prefill=True)
    chunked = OwnModel(path)
    req = chunked.new_request(prompt, 0)
    parts = [chunked.step([req], [min(64, 300 - s)], is_prefill=True) for s in range(0, 300, 64)]
    assert rel_err(torch.cat(parts), ref) <= 1e-5


def test_chunked_engine_equals_unchunked_engine(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    prompt = torch.randint(3, 1024, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    chunked = make_engine(path, "scheduler.chunked_prefill_size=64", "graphs.prefill.max_tokens=64")
    out = chunked.generate([prompt], params)[0]
    assert [s.num_tokens for s in chunked.step_stats if s.phase == "prefill"] == [64, 64, 64, 64, 44]
    whole = make_engine(path).generate([prompt], params)[0]
    assert out.token_ids == whole.token_ids


def test_staggered_arrivals_equal_alone(checkpoint_dir):
    path = checkpoint_dir("tiny-qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(4, 20), temperature=0, ignore_eos=True) for _ in prompts]
    alone = make_engine(path)
    expected = [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]

    engine = make_engine(path, "scheduler.chunked_prefill_size=96", "graphs.prefill.max_tokens=96")
    ids, pending = [], list(zip(prompts, params))
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                p, sp = pending.pop(0)
                ids.append(engine.add_request(p, sp))
        engine.step()
    assert [engine.output(i).token_ids for i in ids] == expected
    assert max(s.batch_size for s in engine.step_stats if s.phase == "decode") > 1


def test_seeded_sampling_independent_of_batching(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine(path).generate([[5, 6, 7, 8]], params)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
    batched = make_engine(path).generate([[9, 9, 9], [5, 6, 7, 8], [4] * 20], [others, params, others])
    assert batched[1].token_ids == alone


def test_random_requests_pages_return_and_preemption(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    engine = make_engine(path, "cache.num_pages=40", "cache.page_size=16", "scheduler.max_running_requests=24",
                         "scheduler.chunked_prefill_size=256", "graphs.prefill.max_tokens=256")
    start_free = engine.num_free_pages
    rng = random.Random(7)
    expected: dict[str, int] = {}
    to_abort: dict[str, int] = {}
    for i in range(200):
        n = rng.randint(1, 120)
        params = SamplingParams(max_tokens=rng.randint(1, 80), temperature=rng.choice([0, 0.8]),
                                seed=i, ignore_eos=True)
        rid = engine.add_request([rng.randrange(3, 1024) for _ in range(n)], params)
        if i % 3 == 0:
            to_abort[rid] = rng.randint(0, 30)
        else:
            expected[rid] = params.max_tokens
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        for rid, at in list(to_abort.items()):
            if steps >= at:
                engine.abort(rid)
                del to_abort[rid]
        assert steps < 20_000
    assert engine.num_free_pages == start_free
    for rid, n in expected.items():
        out = engine.output(rid)
        assert out.finish_reason == "length" and len(out.token_ids) == n, rid
    assert engine.scheduler.num_preemptions >= 1
    assert any(engine.output(rid).finish_reason == "abort" for rid in engine.requests if rid not in expected)


def test_preempted_request_output_unchanged(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1024) for _ in range(40)] for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = make_engine(path).generate(prompts, params)
    tight = make_engine(path, "cache.num_pages=20")
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions >= 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_too_long_prompt_rejected_engine_keeps_serving(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    engine = make_engine(path, "model.max_model_len=128")
    good = engine.add_request([5] * 10, SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(RequestRejected, match=r"prompt has 200 tokens; max_model_len is 128"):
        engine.add_request([5] * 200, SamplingParams(max_tokens=5))
    with pytest.raises(RequestRejected, match=r"token id 5000 outside the vocabulary \[0, 1024\)"):
        engine.add_request([1, 5000])
    with pytest.raises(RequestRejected, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(RequestRejected, match=r"logit_bias token id 1024 outside the vocabulary \[0, 1024\)"):
        engine.add_request([5, 6], SamplingParams(logit_bias={1024: 5.0}))  # on the device: an index past the logits
    assert list(engine.requests) == [good]
    forced = engine.generate([[5] * 10], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                        logit_bias={77: 100}))[0]
    assert forced.token_ids == [77] * 4
    while engine.has_unfinished():
        engine.step()
    assert len(engine.output(good).token_ids) == 5


def test_prompt_limits_raise_one_type_per_problem():
    limits = PromptLimits(vocab_size=1024, max_model_len=8)
    limits.check([0, 1023] * 3 + [7])
    with pytest.raises(EmptyPrompt, match="^prompt is empty$"):
        limits.check([])
    with pytest.raises(TokenOutsideVocabulary, match=r"^prompt token id -1 outside the vocabulary \[0, 1024\)$"):
        limits.check([5, -1, 5000] * 4)  # the first bad id, before the length
    with pytest.raises(PromptTooLong, match="^prompt has 8 tokens; max_model_len is 8, the maximum context length"):
        limits.check([5] * 8)
    with pytest.raises(NoTokenizer, match="no tokenizer.json: pass token ids"):
        encode_prompt("hi", None)
    assert encode_prompt((5, 6), None) == [5, 6]
    problems = (EmptyPrompt, TokenOutsideVocabulary, PromptTooLong, NoTokenizer)
    assert all(issubclass(e, RequestRejected) for e in problems)


def test_generation_stops_at_max_model_len(checkpoint_dir):
    engine = make_engine(checkpoint_dir("tiny-llama"), "model.max_model_len=32")
    out = engine.generate([[5] * 30], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_invalid_sampling_params_name_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_stop_strings_and_streaming_text(checkpoint_dir):
    path = checkpoint_dir("tiny-llama")
    engine = make_engine(path)
    free = engine.num_free_pages
    base = engine.generate(["The fleet"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert base.text
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 2]
    stopped = engine.generate(["The fleet"], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert base.text.startswith(stopped.text)
    assert stopped.stop_reason == stop and base.stop_reason is None  # vLLM's stop_reason: what matched
    # Of two stop strings, the one found earlier in the text is the reason, whatever the list order.
    later = base.text[-2:]  # first found after ``stop``'s first place (its own text ends before it)
    assert base.text.find(later) > base.text.find(stop)
    both = engine.generate(["The fleet"], SamplingParams(max_tokens=24, temperature=0, stop=[later, stop]))[0]
    assert both.stop_reason == stop and both.text == stopped.text
    pieces = [ev.text for ev in engine.stream("The fleet", SamplingParams(max_tokens=24, temperature=0,
                                                                          ignore_eos=True))]
    assert "".join(pieces) == base.text
    # A stop token id is the reason as an int; its event says so too.
    k = next(i for i in range(1, len(base.token_ids)) if base.token_ids[i] not in base.token_ids[:i])
    token = base.token_ids[k]
    by_id = engine.generate(["The fleet"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[token]))[0]
    assert (by_id.finish_reason, by_id.stop_reason, len(by_id.token_ids)) == ("stop", token, k + 1)
    last = list(engine.stream("The fleet", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[token])))[-1]
    assert last.finished and last.stop_reason == token
    assert engine.num_free_pages == free


def test_first_token_event_carries_the_engine_queue_and_prefill_times(checkpoint_dir):
    """Only the event of a request's first output token has phases: (queue, prefill) seconds, as vLLM's
    request_queue_time_seconds and request_prefill_time_seconds; a later request queued behind a
    full batch waits longer than the first."""
    engine = make_engine(checkpoint_dir("tiny-llama"))
    events = list(engine.stream([5] * 40, SamplingParams(max_tokens=4, ignore_eos=True)))
    assert events[0].token_ids and events[0].phases is not None and all(e.phases is None for e in events[1:])
    queue, prefill = events[0].phases
    assert 0 <= queue < prefill


def test_stream_closed_early_aborts_and_frees(checkpoint_dir):
    engine = make_engine(checkpoint_dir("tiny-llama"))
    free = engine.num_free_pages
    it = engine.stream([5] * 50, SamplingParams(max_tokens=50, ignore_eos=True))
    next(it)
    next(it)
    it.close()
    assert engine.num_free_pages == free and not engine.has_unfinished()


def test_step_stats_recorded(checkpoint_dir):
    engine = make_engine(checkpoint_dir("tiny-llama"))
    engine.generate([[5] * 20, [6] * 3], SamplingParams(max_tokens=4, ignore_eos=True))
    phases = [(s.phase, s.batch_size, s.num_tokens) for s in engine.step_stats]
    assert phases[0] == ("prefill", 2, 23)
    assert phases[1:] == [("decode", 2, 2)] * 3
    assert all(s.duration_s > 0 for s in engine.step_stats)


def test_step_message_wire_form_round_trips():
    """A StepMessage pickles (as Ray's cloudpickle does) to an equal message; rows that shared one
    SamplingParams object share one after unpickling, and validated fields are kept as they were."""
    import pickle

    from ray import cloudpickle

    from worker.step_message import StepMessage

    shared = SamplingParams(max_tokens=9, temperature=0.7, top_k=5, stop=["a", "bc"], stop_token_ids=[3])
    own = SamplingParams(max_tokens=4, seed=2**64 - 1, logprobs=True)
    msg = StepMessage(False, [5, 6, 7], [10, 3, 8], [11, 4, 9], [1, 1, 1], [[0, 1], [2], [3, 4]], [0, 1, 2],
                      [shared, own, shared], [1, 2**64 - 1, 3], [0, 1, 2], return_logits=True)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(msg, protocol=5))
        assert back == msg
        assert back.params[0] is back.params[2] and back.params[0] is not back.params[1]
        assert back.params[0].stop == ("a", "bc") and hash(back.params[1]) == hash(own)


def test_request_tokens_slices_prompt_and_output_without_building_both():
    from worker.request import Request

    r = Request("r", [1, 2, 3, 4], SamplingParams(), 0, 0)
    r.output_ids = [5, 6, 7]
    full = r.token_ids
    assert all(r.tokens(a, b) == full[a:b] for a in range(9) for b in range(a, 10))
