"""Request preprocessing (deploy/preprocess.py) without Serve: the bounds checked before tokenizing, the
tokenizer's bytes-per-token bound, and the pool of processes that runs it (a worker killed mid-request)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from deploy.config import ConfigError, load_config
from deploy.errors import ApiError
from deploy.preprocess import MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, prepare
from deploy.preprocess_pool import Preprocessor
from worker.admission import PromptLimits
from worker.tokenizer import Tokenizer
from worker.tokenizer_bounds import max_bytes_per_token

PRESETS = ["tiny-llama", "tiny-llama2", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]


@pytest.fixture(scope="module")
def tokenizers(checkpoint_dir):
    return {name: Tokenizer.from_dir(checkpoint_dir(name)) for name in PRESETS}


def _texts(tok: Tokenizer, rng: random.Random) -> list[str]:
    """Texts that stress the bound: long words, spaces, special tokens, composing and wide characters."""
    vocab = [t for t in (tok.id_to_token(i) for i in range(tok.vocab_size)) if t]
    pieces = ["the", " ", "  ", "\n", "x" * 300, "é", "e\u0301", "\u1100\u1161\u11a8", "\U0001d400", "Ｈ", "\u212a",
              "🙂", "\t", "0123456789", tok.bos_token or "", tok.eos_token or "", *rng.sample(vocab, 50)]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 400))) for _ in range(60)]


def test_no_token_stands_for_more_bytes_than_the_bound(tokenizers):
    rng = random.Random(0)
    for name, tok in tokenizers.items():
        per_token = tok.max_bytes_per_token
        assert per_token is not None and per_token >= 4, name
        for text in _texts(tok, rng):
            ids = tok.encode(text, add_special_tokens=False)
            assert len(text.encode()) <= per_token * len(ids), (name, text[:80], len(ids))


def _spec(model, normalizer=None, pre_tokenizer=None) -> str:
    tok = BackendTokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def test_the_bound_is_none_wherever_text_can_vanish():
    bpe = models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "?": 3}, merges=[("a", "b")], unk_token="?")
    assert max_bytes_per_token(_spec(bpe)) == 4  # an unknown character (<= 4 bytes) per unknown token
    assert max_bytes_per_token(_spec(bpe, normalizers.NFKC())) == 16
    assert max_bytes_per_token(_spec(bpe, normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]))) == 48
    fused = models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True)
    assert max_bytes_per_token(_spec(fused)) is None  # a run of unknowns is one token
    assert max_bytes_per_token(_spec(bpe, normalizers.Strip())) is None
    assert max_bytes_per_token(_spec(bpe, normalizers.Replace(" ", ""))) is None
    assert max_bytes_per_token(_spec(bpe, pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert max_bytes_per_token(_spec(bpe, pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed"))) is None
    assert max_bytes_per_token(_spec(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))) is None
    truncating = BackendTokenizer.from_str(_spec(bpe))
    truncating.enable_truncation(8)
    assert max_bytes_per_token(truncating.to_str()) is None


# ----- prepare: every bound before tokenizing, one 400 naming the field each -----

@pytest.fixture(scope="module")
def llama(tokenizers):
    return tokenizers["tiny-llama"]


LIMITS = PromptLimits(vocab_size=4096, max_model_len=256)


def _body(**fields) -> bytes:
    return json.dumps({"model": "tiny", **fields}).encode()


def _refused(route: str, raw: bytes, tok, limits=LIMITS) -> ApiError:
    with pytest.raises(ApiError) as e:
        prepare(route, raw, tok, limits)
    assert e.value.status == 400
    return e.value


def test_prepare_expands_choices_and_seeds(llama):
    prepared = prepare("completions", _body(prompt=["a b", "c"], n=3, seed=7, max_tokens=4), llama, LIMITS)
    assert prepared.request.prompt == [] and prepared.prompts == [llama.encode("a b"), llama.encode("c")]
    assert [i for i, _ in prepared.choices] == [0, 0, 0, 1, 1, 1]
    assert [params.seed for _, params in prepared.choices] == [7, 8, 9, 7, 8, 9]
    chat = prepare("chat", _body(messages=[{"role": "user", "content": "hi"}]), llama, LIMITS)
    assert chat.request.messages == [] and chat.choices[0][1].max_tokens == 256 - len(chat.prompts[0])


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(llama):
    per_token = llama.max_bytes_per_token
    word = "x" * (LIMITS.max_model_len * per_token + 1)
    started = time.perf_counter()
    e = _refused("completions", _body(prompt=word * 200), llama)  # 200x over: tokenizing it would take seconds
    assert time.perf_counter() - started < 0.5
    assert e.param == "prompt[0]" and e.code == "context_length_exceeded"
    assert f"no token of this model stands for more than {per_token} bytes" in e.message
    assert "max_model_len=256" in e.message
    e = _refused("chat", _body(messages=[{"role": "user", "content": word}]), llama)
    assert e.param == "messages" and e.code == "context_length_exceeded"
    fits = "x " * 40  # well under the bound, and few tokens
    assert prepare("completions", _body(prompt=fits), llama, LIMITS).prompts[0] == llama.encode(fits)


@pytest.mark.parametrize("fields, param, needle", [
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "n", f"{MAX_CHOICES + 1} choices; at most {MAX_CHOICES}"),
    ({"prompt": "a", "n": MAX_CHOICES + 1}, "n", f"n must be in 1..{MAX_CHOICES}"),
    ({"prompt": "a", "stop": ["s"] * (MAX_STOP_SEQUENCES + 1)}, "stop", f"at most {MAX_STOP_SEQUENCES}"),
    ({"prompt": "a", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop", f"at most {MAX_STOP_CHARS}"),
    ({"prompt": "a", "max_tokens": 300}, "max_tokens", "at most"),
    ({"prompt": [1, 2, 5000]}, "prompt", "outside the vocabulary"),
    ({"prompt": list(range(1, 257))}, "prompt", "max_model_len is 256"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 100], got 0"),
    ({"prompt": "a", "stop_token_ids": [1, 4096]}, "stop_token_ids", "4096 is outside the vocabulary [0, 4096)"),
    ({"prompt": "a", "stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
    ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({"prompt": "a", "logit_bias": {"4096": 1}}, "logit_bias", "token id 4096 is outside the vocabulary [0, 4096)"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids, got 'x'"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be in [-100, 100], got 101"),
    ({"prompt": "a", "logit_bias": {"5": 1, "05": 2}}, "logit_bias", "names a token id twice"),
    ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ({"prompt": "a", "logit_bias": {"5": "up"}}, "logit_bias.5", "Input should be"),
    ({"prompt": 5}, "prompt", "Input should be"),
])
def test_each_bound_is_a_400_naming_its_field(llama, fields, param, needle):
    e = _refused("completions", _body(**fields), llama)
    assert e.param == param and needle in e.message, e.message


@pytest.mark.parametrize("field, value", [
    ("suffix", "tail"), ("best_of", 2), ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("min_tokens", 5), ("skip_special_tokens", False),
    ("guided_json", {"type": "object"}), ("prompt_logprobs", 1), ("use_beam_search", True),
])
def test_a_field_this_server_cannot_honour_is_a_400_naming_it(llama, field, value):
    for route, body in (("completions", {"prompt": "a"}), ("chat", {"messages": [{"role": "user", "content": "a"}]})):
        e = _refused(route, _body(**body, **{field: value}), llama)
        assert e.param == field and e.message.startswith(f"{field} is not supported by this server: "), e.message


def test_the_no_op_values_of_those_fields_and_the_ignored_ones_are_accepted(llama, caplog):
    noops = {"logit_bias": {}, "suffix": "", "best_of": 1, "response_format": {"type": "text"}, "tools": [],
             "tool_choice": "none", "repetition_penalty": 1.0, "skip_special_tokens": True,
             "include_stop_str_in_output": False, "user": "u-1", "store": False, "metadata": {"k": "v"},
             "service_tier": "auto", "parallel_tool_calls": True}
    plain = prepare("completions", _body(prompt="a b", max_tokens=3), llama, LIMITS)
    got = prepare("completions", _body(prompt="a b", max_tokens=3, **noops), llama, LIMITS)
    assert got.prompts == plain.prompts and got.choices == plain.choices
    # min_tokens holds whatever its value when every choice runs to max_tokens anyway.
    assert prepare("completions", _body(prompt="a", max_tokens=3, min_tokens=3, ignore_eos=True), llama, LIMITS)
    e = _refused("completions", _body(prompt="a", max_tokens=3, min_tokens=3, ignore_eos=True, stop=["x"]), llama)
    assert e.param == "min_tokens"
    with caplog.at_level("WARNING", logger="deploy.request_fields"):
        for _ in range(2):
            prepare("completions", _body(prompt="a", max_tokens=2, some_vendor_field_xyz=1), llama, LIMITS)
    logged = [r for r in caplog.records if "some_vendor_field_xyz" in r.getMessage()]
    assert len(logged) == 1 and "ignored" in logged[0].getMessage()  # once per name and process


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_out_of_range_get_the_range_and_in_range_ones_reach_the_sampling_params(llama, field):
    e = _refused("completions", _body(prompt="a", **{field: 5.0}), llama)
    assert e.param == field and e.message == f"{field} must be in [-2, 2], got 5.0"
    got = prepare("chat", _body(messages=[{"role": "user", "content": "a"}], **{field: -0.5}), llama, LIMITS)
    assert getattr(got.choices[0][1], field) == -0.5 and got.choices[0][1].penalized
    got = prepare("completions", _body(prompt="a", max_tokens=2, repetition_penalty=1.3), llama, LIMITS)
    assert got.choices[0][1].repetition_penalty == 1.3
    neutral = prepare("completions", _body(prompt="a", max_tokens=2, **{field: 0}), llama, LIMITS)
    assert not neutral.choices[0][1].penalized


def test_logit_bias_reaches_the_sampling_params(llama):
    got = prepare("completions", _body(prompt="a", logit_bias={"9": -100, "3": 2.5}), llama, LIMITS)
    assert got.choices[0][1].logit_bias == ((3, 2.5), (9, -100.0))


def test_stop_token_ids_reach_the_sampling_params(llama):
    got = prepare("chat", _body(messages=[{"role": "user", "content": "a"}], stop_token_ids=[7, 9]), llama, LIMITS)
    assert got.choices[0][1].stop_token_ids == (7, 9)


def test_chat_chunk_deltas_leave_out_the_keys_they_do_not_set():
    from deploy import openai_protocol as p
    from deploy.streaming import _data

    def delta(d):
        chunk = p.ChatCompletionChunk(id="c", created=1, model="m", choices=[
            p.ChatChunkChoice(index=0, delta=d, finish_reason="stop" if d.content is None else None)])
        body = json.loads(_data(chunk).removeprefix("data: "))
        assert body["choices"][0]["logprobs"] is None and "finish_reason" in body["choices"][0]
        return body["choices"][0]["delta"]

    assert delta(p.ChatDelta(role="assistant", content="")) == {"role": "assistant", "content": ""}
    assert delta(p.ChatDelta(content="hi")) == {"content": "hi"}  # no "role": null after the first chunk
    assert delta(p.ChatDelta()) == {}


def test_malformed_bodies(llama):
    assert _refused("completions", b"{not json", llama).code == "invalid_json"
    assert "must be a JSON object" in _refused("chat", b"[1, 2]", llama).message


# ----- the pool -----

def _pool_pids(parent: int) -> list[int]:
    """The pool workers (multiprocessing's spawned children) of process ``parent``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    spawned = b"spawn_main" in f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and spawned:
                pids.append(int(entry))
    return pids


@pytest.mark.timeout(120)
def test_pool_answers_and_a_killed_worker_costs_only_its_request(checkpoint_dir, llama):
    import asyncio

    pool = Preprocessor(str(checkpoint_dir("tiny-llama")), workers=1)
    try:
        async def scenario():
            ok = await pool.prepare("completions", _body(prompt="a b c"), LIMITS)
            assert ok.prompts == [llama.encode("a b c")]
            with pytest.raises(ApiError) as e:
                await pool.prepare("completions", _body(prompt="a", n=99), LIMITS)
            assert e.value.status == 400 and e.value.param == "n"  # an ApiError crosses the process boundary
            # A body that takes the worker a while (a 12 MB list of ids), killed while it parses.
            slow = asyncio.ensure_future(pool.prepare("completions", _body(prompt=[1] * 4_000_000), LIMITS))
            await asyncio.sleep(0.1)
            (worker,) = _pool_pids(os.getpid())
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(ApiError) as e:
                await slow
            assert e.value.status == 500 and "died" in e.value.message
            again = await pool.prepare("completions", _body(prompt="a b c"), LIMITS)  # a new pool serves
            assert again.prompts == ok.prompts

        asyncio.run(scenario())
    finally:
        pool.shutdown()


@pytest.mark.timeout(120)
def test_bodies_sent_together_share_worker_calls_and_keep_their_own_answers(checkpoint_dir, llama):
    """64 bodies at once through two workers: each gets its own answer (a bad body its own 400, the
    others their prompts, in their order), and they travel in fewer calls than bodies."""
    import asyncio

    pool = Preprocessor(str(checkpoint_dir("tiny-llama")), workers=2)
    calls = []
    submit = pool._pool.submit

    def counting_submit(fn, *args):
        calls.append(len(args[0]) if fn.__name__ == "_prepare_batch_in_worker" else 1)
        return submit(fn, *args)

    pool._pool.submit = counting_submit
    try:
        async def scenario():
            texts = [f"w{i} x y" for i in range(64)]
            bodies = [_body(prompt=t, n=99) if i % 16 == 5 else _body(prompt=t) for i, t in enumerate(texts)]
            answers = await asyncio.gather(*(pool.prepare("completions", b, LIMITS) for b in bodies),
                                           return_exceptions=True)
            for i, (text, answer) in enumerate(zip(texts, answers, strict=True)):
                if i % 16 == 5:
                    assert isinstance(answer, ApiError) and answer.status == 400 and answer.param == "n", answer
                else:
                    assert answer.prompts == [llama.encode(text)], i

        asyncio.run(scenario())
    finally:
        pool.shutdown()
    assert sum(calls) == 64 and len(calls) < 64 and max(calls) <= 16, calls


@pytest.mark.timeout(120)
def test_bodies_sent_after_the_workers_died_are_answered_by_a_new_pool(checkpoint_dir, llama):
    """Workers killed while idle: the next bodies are neither lost nor hung (each answered, by the
    new pool or with a 500 naming the death), and the bodies after them are served."""
    import asyncio

    pool = Preprocessor(str(checkpoint_dir("tiny-llama")), workers=2)
    try:
        async def scenario():
            assert (await pool.prepare("completions", _body(prompt="a b"), LIMITS)).prompts == [llama.encode("a b")]
            for worker in _pool_pids(os.getpid()):
                os.kill(worker, signal.SIGKILL)
            await asyncio.sleep(0.5)
            answers = await asyncio.wait_for(asyncio.gather(
                *(pool.prepare("completions", _body(prompt=f"x{i}"), LIMITS) for i in range(8)),
                return_exceptions=True), timeout=60)
            for i, answer in enumerate(answers):
                if isinstance(answer, ApiError):
                    assert answer.status == 500 and "died" in answer.message, answer
                else:
                    assert answer.prompts == [llama.encode(f"x{i}")]
            again = await asyncio.wait_for(pool.prepare("completions", _body(prompt="a b"), LIMITS), timeout=60)
            assert again.prompts == [llama.encode("a b")]

        asyncio.run(scenario())
    finally:
        pool.shutdown()


@pytest.mark.timeout(120)
def test_small_bodies_are_prepared_inline_and_large_ones_in_the_pool(checkpoint_dir, llama):
    """serve.preprocess_inline_bytes: a body up to that size is prepared on the caller's loop (no pool
    call; its own 400 raised there), a larger one goes to a worker; both answers equal prepare's."""
    import asyncio

    path = str(checkpoint_dir("tiny-llama"))
    small, large = _body(prompt="a b c"), _body(prompt=[5] * 200)
    assert len(small) <= 512 < len(large)
    pool = Preprocessor(path, workers=1, inline_bytes=512, tokenizer=llama)
    calls = []
    submit = pool._pool.submit

    def counting_submit(fn, *args):
        calls.append(fn.__name__)
        return submit(fn, *args)

    pool._pool.submit = counting_submit
    try:
        async def scenario():
            inline = await pool.prepare("completions", small, LIMITS)
            assert inline == prepare("completions", small, llama, LIMITS)
            with pytest.raises(ApiError) as e:
                await pool.prepare("completions", _body(prompt="a", n=99), LIMITS)
            assert e.value.status == 400 and e.value.param == "n"
            assert calls == []
            pooled = await pool.prepare("completions", large, LIMITS)
            assert pooled.prompts == [[5] * 200] and calls == ["_prepare_batch_in_worker"]

        asyncio.run(scenario())
    finally:
        pool.shutdown()
    with pytest.raises(ConfigError, match="preprocess_inline_bytes"):
        load_config(None, ["serve.preprocess_inline_bytes=262145"])
