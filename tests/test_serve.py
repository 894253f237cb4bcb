"""The OpenAI-compatible API on a real local Ray Serve (CPU), driven by the ``openai`` client.

Greedy outputs are compared with the in-process :class:`Engine` on the same checkpoint; bad
requests must get a 4xx with an OpenAI error body naming the problem, and leave the server healthy.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import ray
import torch
from ray import serve

from deploy.config import load_config
from deploy.serve_app import app_builder
from tests.serve_harness import OVERRIDES, host_port, scrape, start_local_serve, total, wait_healthy
from tests.serve_harness import http as _http
from worker.engine import Engine
from worker.sampling.params import SamplingParams

openai = pytest.importorskip("openai")  # absent on the GPU machine; CI installs it (dev extra)

API_KEY = "sk-test-123"
MAX_TOKENS = 8
PROMPTS = ["The fleet of graphs sails at dawn and", "Hello"]
CHUNKS_PER_S = 200  # the replica's chunk budget here: 1 stream waits 5 ms, 10 streams the 50 ms ceiling
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("tiny-llama")


@pytest.fixture(scope="module")
def server(path):
    """Base URL of a running app (colocated fleet, API key required)."""
    yield start_local_serve({"model": str(path), "overrides": [*OVERRIDES, f"serve.stream_chunks_per_s={CHUNKS_PER_S}"],
                             "api_key": API_KEY, "model_name": "tiny", "fleet": {"name": "srv"}}, "graphfleet")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(path):
    """``reference(prompt_or_ids)`` -> the in-process engine's greedy output."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(load_config(None, [f"model.path={path}", *OVERRIDES]))

    def generate(prompt, max_tokens: int = MAX_TOKENS, **sampling):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling)
        return engine.generate([prompt], params)[0]

    yield generate
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def disagg_client(server, path):
    """A client of a second app on the same Serve: a disaggregated 1 prefill + 1 decode fleet, no API key."""
    app = app_builder({"model": str(path), "overrides": OVERRIDES, "model_name": "tiny",
                       "fleet": {"name": "sdis", "mode": "disaggregated"}})
    serve.run(app, name="graphfleet-dis", route_prefix="/dis", blocking=False)
    wait_healthy(f"{server}/dis")
    yield openai.OpenAI(base_url=f"{server}/dis/v1", api_key="unused", max_retries=0, timeout=120)
    serve.delete("graphfleet-dis")


def _chat_ids(path):
    from worker.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True), add_special_tokens=False)


def test_health_is_open_and_ready(server):
    status, body, _ = _http("GET", f"{server}/health")
    assert status == 200, body
    assert body["status"] == "ready" and all(s == "ready" for s in body["groups"].values())
    assert _http("GET", f"{server}/live")[:2] == (200, {"status": "alive"})  # open too: no API key
    status, text, _ = _http("GET", f"{server}/metrics")
    assert status == 200 and "prompt_tokens" in text


def test_api_key_required(server):
    status, body, _ = _http("GET", f"{server}/v1/models")
    assert status == 401 and "missing API key" in body["error"]["message"]
    status, body, _ = _http("GET", f"{server}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["message"] == "invalid API key"
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    status, body, _ = _http("GET", f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and body["data"][0]["id"] == "tiny"


def test_completions_match_engine(client, reference):
    for prompt in PROMPTS:
        ref = reference(prompt)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == MAX_TOKENS == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS

        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    # vLLM's stop_token_ids extension: the greedy output ends at the first new token after its first.
    ids = reference(PROMPTS[0]).token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].stop_reason == ids[k]  # vLLM's field: the stop token id (a stop string: the string)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]}))
    ended = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ended) == 1 and ended[0].finish_reason in ("stop", "length")
    assert ended[0].stop_reason == (ids[k] if ended[0].finish_reason == "stop" else None)
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    # logit_bias: +100 forces a token at every position, -100 bans the greedy first token; the engine
    # with the same bias is the reference.
    for bias in ({77: 100.0}, {ids[0]: -100.0}):
        ref = reference(PROMPTS[0], max_tokens=3, logit_bias=bias)
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                      logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
    assert reference(PROMPTS[0], max_tokens=3, logit_bias={77: 100.0}).token_ids == [77] * 3
    assert reference(PROMPTS[0], max_tokens=1, logit_bias={ids[0]: -100.0}).token_ids != ids[:1]


def _stream_texts(client, prompt, max_tokens):
    """The text chunks of a streamed greedy completion (usage in every chunk) and the median gap
    between their arrivals (seconds)."""
    texts, times = [], []
    for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].text:
            texts.append(c)
            times.append(time.monotonic())
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return texts, gaps[len(gaps) // 2] if gaps else None


def test_stream_interval_follows_the_open_streams(client, reference, server):
    """The stream batching interval follows the load (serve.stream_chunks_per_s=200 here, ceiling
    serve.stream_batching_interval_ms=50): a lone stream waits 5 ms (a token or two to a chunk),
    ten at once wait up to 50 ms (several tokens to a chunk); the same text either way, and usage
    in every chunk when asked for."""
    prompt, max_tokens, streams = PROMPTS[0], 48, 10
    ref = reference(prompt, max_tokens)
    texts, lone_gap = _stream_texts(client, prompt, max_tokens)
    assert "".join(c.choices[0].text for c in texts) == ref.text
    counts = [c.usage.completion_tokens for c in texts]
    assert counts[-1] == max_tokens and counts == sorted(counts)
    # Below the 50 ms ceiling a fixed interval would impose (the CPU's own step, ~5-28 ms, sets the pace).
    assert lone_gap < 0.040, f"a lone stream's chunks came {lone_gap * 1e3:.1f} ms apart (median)"

    results: list = [None] * streams

    def one(i: int) -> None:
        results[i] = _stream_texts(client, prompt, max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for texts, _ in results:
        assert "".join(c.choices[0].text for c in texts) == ref.text
    busy_gap = sorted(gap for _, gap in results)[streams // 2]
    print(f"median chunk gap: lone {lone_gap * 1e3:.1f} ms, ten streams {busy_gap * 1e3:.1f} ms")
    assert busy_gap > 0.030, f"ten streams' chunks came {busy_gap * 1e3:.1f} ms apart (median of medians)"
    assert total(scrape(server), "graphfleet_stream_batching_interval_seconds") == 0.0  # none open now


def test_batched_prompts_n_and_logprobs(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                  logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    refs = [reference(p) for p in PROMPTS]
    assert [c.text for c in r.choices] == [refs[0].text] * 2 + [refs[1].text] * 2
    assert all(len(c.logprobs.token_logprobs) == MAX_TOKENS for c in r.choices)
    assert r.usage.completion_tokens == 4 * MAX_TOKENS


def test_chat_matches_engine(client, reference, path):
    ref = reference(_chat_ids(path))
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == MAX_TOKENS

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_disaggregated_matches_engine(disagg_client, reference, path):
    for prompt in PROMPTS:
        ref = reference(prompt)
        r = disagg_client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == MAX_TOKENS
        chunks = list(disagg_client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    ref = reference(_chat_ids(path))
    r = disagg_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text


def test_usage_reports_cached_prompt_tokens(client, disagg_client, reference, path):
    """Prefix caching (on by default): a prompt starting with the 64 tokens (4 pages) of one served
    before reports them in ``usage.prompt_tokens_details.cached_tokens``, OpenAI's field, streamed
    (include_usage) or not; colocated, and disaggregated, where the prefill group caches. Outputs are
    still the engine's. Chat: the two conversations' common full pages."""
    from worker.tokenizer import Tokenizer

    gen = torch.Generator().manual_seed(20)
    for c in (client, disagg_client):
        shared = torch.randint(3, 1024, (64,), generator=gen).tolist()
        first = c.completions.create(model="tiny", prompt=shared + [5] * 10, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = shared + [6] * 20
        r = c.completions.create(model="tiny", prompt=second, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens_details.cached_tokens == 64 and r.usage.prompt_tokens == 84
        assert r.choices[0].text == reference(second).text
        chunks = list(c.completions.create(model="tiny", prompt=shared + [7] * 3, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64

    tok = Tokenizer.from_dir(path)
    system = {"role": "system", "content": "You answer questions about lighthouses, keepers and the sea. " * 4}
    chats = [[system, {"role": "user", "content": q}] for q in ("Who kept the light?", "What did he dry?")]
    ids = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
           for m in chats]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    expect = min(common, len(ids[1]) - 1) // 16 * 16
    assert expect >= 32
    for m in chats:
        r = client.chat.completions.create(model="tiny", messages=m, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens_details.cached_tokens == expect


def test_sse_wire_format(server):
    status, text, hdrs = _http("POST", f"{server}/v1/completions",
                               {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True,
                                "ignore_eos": True}, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks and not any("usage" in c for c in chunks), "usage not asked for: no usage key (OpenAI's)"

    status, text, _ = _http("POST", f"{server}/v1/completions",
                            {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True,
                             "stream_options": {"include_usage": True}}, {"Authorization": f"Bearer {API_KEY}"})
    chunks = [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 3


BAD = [
    # (body, expected status, substring of the message)
    ("{not json", 400, "malformed JSON"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be >= 1"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens is 1000000000"),
    ({"model": "tiny", "prompt": "hi", "temperature": -0.5}, 400, "temperature must be >= 0"),
    ({"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ({"model": "tiny", "prompt": "hi", "n": 1000}, 400, "n must be in 1..16"),
    ({"model": "tiny", "prompt": "hi " * 5000}, 400, "maximum context length"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist"),
    ({"model": "tiny", "prompt": "hi", "stop": [""]}, 400, "stop[0] must be a non-empty string"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 25}, 400, "logprobs must be in [0, 20] or null"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"5000": 100}}, 400, "token id 5000 is outside the vocabulary"),
    ({"model": "tiny", "prompt": "hi", "suffix": "!"}, 400, "suffix is not supported by this server"),
    ({"model": "tiny", "prompt": "hi", "frequency_penalty": 5.0}, 400, "frequency_penalty must be in [-2, 2]"),
]
BAD_CHAT = [
    ({"model": "tiny", "messages": []}, 400, "messages is empty"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "tiny", "messages": "hello"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream: "),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature"),
]


@pytest.mark.parametrize("route,body,status,needle",
                         [("completions", *b) for b in BAD] + [("chat/completions", *b) for b in BAD_CHAT])
def test_bad_input_gets_openai_error(server, route, body, status, needle):
    got, err, _ = _http("POST", f"{server}/v1/{route}", body, {"Authorization": f"Bearer {API_KEY}"})
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert needle in err["error"]["message"], err


def test_healthy_after_bad_input(server, client):
    assert _http("GET", f"{server}/health")[0] == 200
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_client_disconnect_aborts_stream(server):
    """Closing a stream early aborts its request: the fleet is idle long before max_tokens could be reached."""
    import http.client

    models = _http("GET", f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})[1]
    max_tokens = models["data"][0]["max_model_len"] - 8
    host, port = host_port(server)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": max_tokens,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    end = time.monotonic() + 30
    while True:
        metrics = _http("GET", f"{server}/metrics")[1]
        if 'finish_reason="abort"' in metrics and _http("GET", f"{server}/health")[1]["in_flight"] == 0:
            break
        assert time.monotonic() < end, "the disconnected stream's request was not aborted"
        time.sleep(0.1)
    assert _http("GET", f"{server}/health")[0] == 200
