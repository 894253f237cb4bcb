"""Log-probabilities with alternatives and penalties through the engine and the API (issue 19
items 1 and 2), on CPU: the sampler's top-20 is ``log_softmax(logits).topk`` of the unbiased
logits, whatever each row asked; the engine's entries and the API's completions and chat
``logprobs`` equal HF transformers' float32 log-probabilities (rel 1e-4) for greedy and seeded
sampled tokens; a stream carries the same tokens, values and offsets; penalized greedy completions
are the tokens HF's logits give under the penalty formula; bad values get a 400 naming the field."""

from __future__ import annotations

import pytest
import ray
import torch
from ray import serve

from deploy.config import load_config
from tests.reference import hf_logits
from tests.serve_harness import OVERRIDES, start_local_serve
from tests.serve_harness import http as _http
from tests.test_penalties import hf_penalized_greedy
from tests.test_sampling import run
from worker.engine import Engine
from worker.sampling.params import MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError
from worker.tokenizer import Tokenizer

openai = pytest.importorskip("openai")  # absent on the GPU machine; CI installs it (dev extra)
transformers = pytest.importorskip("transformers")

K = 5
PROMPT = [5, 17, 301, 44, 9, 260, 71]
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tokenizer(path):
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def server(path):
    yield start_local_serve({"model": str(path), "overrides": OVERRIDES, "model_name": "tiny",
                             "fleet": {"name": "lp"}}, "graphfleet-lp")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _hf_steps(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's float32 log-probabilities (len(output), vocab) of each output position."""
    return hf_logits(hf, prompt + output)[len(prompt) - 1: -1].log_softmax(-1)


def _assert_entries(entries, output: list[int], ref: torch.Tensor, k: int) -> None:
    """Engine entries ``(logprob, ids, logprobs)`` against HF's log-probabilities ``ref``."""
    assert len(entries) == len(output) == ref.shape[0]
    for i, (entry, token) in enumerate(zip(entries, output)):
        lp, ids, values = entry
        assert lp == pytest.approx(ref[i, token].item(), rel=1e-4), f"position {i}"
        want = ref[i].topk(k)
        assert ids == want.indices.tolist(), f"position {i}"
        assert values == pytest.approx(want.values.tolist(), rel=1e-4)


def test_the_sampler_returns_the_top_20_of_the_unbiased_logits_for_every_row_when_one_asks():
    torch.manual_seed(11)
    logits = torch.randn(5, 300) * 3
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.8, logprobs=True, top_logprobs=20, logit_bias={7: 100}),
              SamplingParams(temperature=0),  # asked for nothing: its row is computed all the same
              SamplingParams(temperature=1.0, top_k=5, logprobs=True),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=1)]
    out = run(logits, params)
    ref = logits.log_softmax(-1).topk(MAX_TOP_LOGPROBS)
    assert out.top_ids.shape == out.top_logprobs.shape == (5, MAX_TOP_LOGPROBS)
    assert torch.equal(out.top_ids, ref.indices)
    torch.testing.assert_close(out.top_logprobs, ref.values, rtol=0, atol=1e-5)
    assert out.token_ids[1] == 7  # the bias picks the token; the log-probabilities stay unbiased
    assert torch.equal(out.token_ids[[0, 2, 4]], ref.indices[[0, 2, 4], 0])  # greedy: the top alternative
    half = run(logits.bfloat16(), params)  # the top-k runs on the logits' own dtype: same values, exactly
    ref = logits.bfloat16().float().log_softmax(-1).topk(MAX_TOP_LOGPROBS)
    assert half.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(half.top_logprobs, ref.values, rtol=0, atol=1e-5)
    plain = run(logits, [SamplingParams(temperature=0, logprobs=True)] * 5)
    assert plain.top_ids is None and plain.top_logprobs is None and plain.logprobs is not None


@pytest.mark.parametrize(("fields", "message"), [
    ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be in \[0, 20\], got 21"),
    ({"logprobs": True, "top_logprobs": -1}, r"top_logprobs must be in \[0, 20\], got -1"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs must be an int, got bool"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs=True"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be None or in \[0, 20\], got 21"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs must be an int, got float"),
])
def test_bad_top_logprobs_are_refused_naming_the_field(fields, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**fields)


def test_engine_entries_equal_hf_for_greedy_and_sampled_tokens(path, hf):
    engine = Engine(load_config(None, [f"model.path={path}", *OVERRIDES]))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=K)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True, logprobs=True,
                             top_logprobs=MAX_TOP_LOGPROBS)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    outs = engine.generate([PROMPT, PROMPT[:4], PROMPT], [greedy, sampled, plain])
    for out, params in zip(outs, (greedy, sampled)):
        _assert_entries(out.logprobs, out.token_ids, _hf_steps(hf, out.prompt_token_ids, out.token_ids),
                        params.top_logprobs)
    assert outs[2].token_ids == outs[0].token_ids  # a row without alternatives in the same batch
    assert outs[2].logprobs == pytest.approx([lp for lp, _, _ in outs[0].logprobs], abs=1e-6)


def test_completions_and_chat_logprobs_equal_hf(client, server, hf, tokenizer):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=K,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = _greedy_ids(hf, PROMPT, 6)
    ref = _hf_steps(hf, PROMPT, ids)
    spell = [tokenizer.decode([t], skip_special_tokens=False) for t in range(ref.shape[1])]
    assert lp.tokens == [spell[t] for t in ids]
    assert lp.token_logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(ids)], rel=1e-4)
    assert lp.text_offset == [sum(len(spell[t]) for t in ids[:i]) for i in range(len(ids))]
    for i, (t, alternatives) in enumerate(zip(ids, lp.top_logprobs)):
        want = {spell[t]: ref[i, t].item()}  # the chosen token first, then the K most likely (vLLM's dict)
        for j in ref[i].topk(K).indices.tolist():
            want.setdefault(spell[j], ref[i, j].item())
        assert alternatives.keys() == want.keys() and list(alternatives.values()) == pytest.approx(
            list(want.values()), rel=1e-4)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=K,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [x for c in streamed for x in c.token_logprobs] == lp.token_logprobs
    assert [x for c in streamed for x in c.text_offset] == lp.text_offset
    assert [x for c in streamed for x in c.top_logprobs] == lp.top_logprobs

    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True),
                                add_special_tokens=False)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    ids = _greedy_ids(hf, chat_ids, 4)
    ref = _hf_steps(hf, chat_ids, ids)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [spell[t] for t in ids]
    for i, (t, c) in enumerate(zip(ids, content)):
        assert c.logprob == pytest.approx(ref[i, t].item(), rel=1e-4) and c.bytes == list(spell[t].encode())
        top = ref[i].topk(3)
        assert [a.token for a in c.top_logprobs] == [spell[j] for j in top.indices.tolist()]
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(top.values.tolist(), rel=1e-4)


def _greedy_ids(hf, prompt: list[int], n: int) -> list[int]:
    ids: list[int] = []
    for _ in range(n):
        ids.append(int(hf_logits(hf, prompt + ids)[-1].argmax()))
    return ids


def test_echo_returns_the_prompt_with_its_log_probabilities_as_hf(client, hf, tokenizer):
    spell = [tokenizer.decode([t], skip_special_tokens=False) for t in range(hf.config.vocab_size)]
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    c, ref = r.choices[0], hf_logits(hf, PROMPT).log_softmax(-1)
    assert c.text == tokenizer.decode(PROMPT) + plain.choices[0].text
    lp, n = c.logprobs, len(PROMPT)
    assert lp.tokens == [spell[t] for t in PROMPT] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([ref[i - 1, PROMPT[i]].item() for i in range(1, n)], rel=1e-4)
    for i in range(1, n):  # the prompt token, then its two most likely alternatives (what lm-eval reads)
        want = {spell[PROMPT[i]]: ref[i - 1, PROMPT[i]].item()}
        for j in ref[i - 1].topk(2).indices.tolist():
            want.setdefault(spell[j], ref[i - 1, j].item())
        assert lp.top_logprobs[i].keys() == want.keys()
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(want.values()), rel=1e-4)
    assert lp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 3

    # max_tokens 0: the prompt alone, over several prefill chunks (chunked_prefill_size 512), per prompt
    long = [(7 * i) % 997 + 3 for i in range(700)]
    r = client.completions.create(model="tiny", prompt=[long, PROMPT], max_tokens=0, temperature=0, logprobs=0,
                                  echo=True)
    assert r.usage.completion_tokens == 0 and [c.finish_reason for c in r.choices] == ["length", "length"]
    for c, ids in zip(r.choices, (long, PROMPT)):
        ref = hf_logits(hf, ids).log_softmax(-1)
        assert c.text == tokenizer.decode(ids) and c.logprobs.tokens == [spell[t] for t in ids]
        assert c.logprobs.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                              rel=1e-4, abs=1e-5)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [x.choices[0] for x in chunks if x.choices]
    assert "".join(x.text for x in streamed) == tokenizer.decode(PROMPT) + plain.choices[0].text
    assert [v for x in streamed if x.logprobs for v in x.logprobs.token_logprobs] == lp.token_logprobs
    assert [t for x in streamed if x.logprobs for t in x.logprobs.tokens] == lp.tokens


def test_penalized_completions_and_chat_are_the_formulas_tokens(client, hf, tokenizer):
    fields = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "repetition_penalty": 1.3}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
                                  presence_penalty=1.2, frequency_penalty=0.8)
    want = hf_penalized_greedy(hf, PROMPT, SamplingParams(max_tokens=10, temperature=0, **fields))
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in want]
    assert want != _greedy_ids(hf, PROMPT, 10)  # the penalties changed the output
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True),
                                add_special_tokens=False)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       frequency_penalty=-1.5, extra_body={"ignore_eos": True})
    want = hf_penalized_greedy(hf, chat_ids, SamplingParams(max_tokens=6, temperature=0, frequency_penalty=-1.5))
    assert [c.token for c in r.choices[0].logprobs.content] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in want]


@pytest.mark.parametrize(("route", "body", "param", "message"), [
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20] or null, got 21"),
    ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be in [0, 20] or null, got 21"),
    ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
    ("completions", {"prompt": "hi", "repetition_penalty": -1}, "repetition_penalty",
     "repetition_penalty must be in (0, 100], got -1"),
    ("chat/completions", {"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be in [-2, 2], got 3"),
])
def test_bad_logprobs_get_a_400_naming_the_field(server, route, body, param, message):
    status, answer, _ = _http("POST", f"{server}/v1/{route}", {"model": "tiny", "max_tokens": 2, **body})
    error = answer["error"]
    assert status == 400 and error["param"] == param and message in error["message"], answer
