"""worker.tokenizer against HF transformers' AutoTokenizer on checkpoints we write."""

from __future__ import annotations

import json
import shutil

import pytest

from worker.checkpoint import PRESETS, write_tokenizer
from worker.checkpoint.writer import generation_config_dict
from worker.detokenizer import IncrementalDecoder
from worker.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TINY = ["tiny-llama", "tiny-llama2", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]

TEXTS = [
    "Hello world!",
    "The lighthouse flashed twice every 15 seconds, then 1234567 more times.",
    "  leading spaces,\ttabs\n\nand blank lines  \n",
    "café naïve Zürich 東京 Москва — “quotes” …",
    "emoji 🙂👍🏽 family 👩‍👩‍👧 flag 🇳🇴 zwj 👩‍💻",
    "def f(x):\n    return {'a': x ** 2}  # comment",
    "tokens that look special: <s> </s> <|im_start|> <|eot_id|> <|extra_900|>",
    "",
    " ",
    "ünïcödé\u0000nul and \u2028 separator",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And 3+3? 🙂  "},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
    ],
]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    dirs = {}
    for name in TINY:
        d = write_tokenizer(name, root / name)
        preset = PRESETS[name]
        (d / "config.json").write_text(json.dumps(preset.config_dict()))
        (d / "generation_config.json").write_text(json.dumps(generation_config_dict(preset)))
        dirs[name] = d
    return dirs


def _hf(path):
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", TINY)
def test_encode_decode_match_hf(tok_dirs, name):
    path = tok_dirs[name]
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    preset = PRESETS[name]
    assert ours.vocab_size == len(hf) == preset.vocab_size
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id == preset.eos_token_id
    assert ours.eos_token_ids == preset.generation_eos_token_ids
    assert ours.pad_token_id == hf.pad_token_id
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    if preset.family.add_bos_token:
        assert ours.encode("hi")[0] == preset.bos_token_id
        assert ours.encode("hi", add_special_tokens=False)[0] != preset.bos_token_id
    else:
        assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)
    every_id = list(range(ours.vocab_size))
    assert ours.decode(every_id, skip_special_tokens=False) == hf.decode(every_id, skip_special_tokens=False)
    assert all(ours.id_to_token(i) is not None for i in every_id)


@pytest.mark.parametrize("name", TINY)
def test_chat_template_matches_hf(tok_dirs, name):
    path = tok_dirs[name]
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    assert ours.chat_template == PRESETS[name].chat_template
    for chat in CHATS:
        for gen in (True, False):
            try:
                expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            except Exception:
                with pytest.raises(ChatTemplateError):
                    ours.apply_chat_template(chat, add_generation_prompt=gen)
                continue
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
    rendered = ours.apply_chat_template(CHATS[1])
    assert ours.encode(rendered, add_special_tokens=False) == hf.encode(rendered, add_special_tokens=False)


def test_chat_template_family_tokens(tok_dirs):
    msgs = [{"role": "user", "content": "hi"}]
    llama3 = Tokenizer.from_dir(tok_dirs["tiny-llama"]).apply_chat_template(msgs)
    assert llama3 == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" + (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    qwen = Tokenizer.from_dir(tok_dirs["tiny-qwen2"])
    rendered = qwen.apply_chat_template(msgs)
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen.encode(rendered, add_special_tokens=False)
    assert ids[0] == PRESETS["tiny-qwen2"].special_token_ids["<|im_start|>"]
    qwen3 = Tokenizer.from_dir(tok_dirs["tiny-qwen3"])
    hf3 = _hf(tok_dirs["tiny-qwen3"])
    no_think = qwen3.apply_chat_template(msgs, enable_thinking=False)
    assert no_think.endswith("<think>\n\n</think>\n\n")
    assert no_think == hf3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    # <think> is an added but non-special token: kept when skipping special tokens.
    think_id = PRESETS["tiny-qwen3"].special_token_ids["<think>"]
    assert qwen3.decode([think_id], skip_special_tokens=True) == "<think>"


def test_raise_exception_in_template(tok_dirs):
    tok = Tokenizer.from_dir(tok_dirs["tiny-llama2"])
    with pytest.raises(ChatTemplateError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(TypeError):
        tok.apply_chat_template(["not a dict"])


def test_default_template_and_jinja_file(tok_dirs, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(tok_dirs["tiny-llama"], path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(path)
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "system: be nice\nuser: hi\nassistant: "
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "system: be nice\nuser: hi\n"
    assert "assistant: " in DEFAULT_CHAT_TEMPLATE
    (path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    tok = Tokenizer.from_dir(path)
    assert tok.apply_chat_template(msgs) == "<|begin_of_text|>[system][user]"
    assert tok.apply_chat_template(msgs) == _hf(path).apply_chat_template(msgs, tokenize=False)


def test_bos_follows_post_processor_then_config_flags(tok_dirs, tmp_path):
    bos, eos = PRESETS["tiny-llama2"].bos_token_id, PRESETS["tiny-llama2"].eos_token_id
    path = tmp_path / "flags"
    shutil.copytree(tok_dirs["tiny-llama2"], path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    # The post-processor wins over the flag, as in HF's fast tokenizers.
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    for text in TEXTS[:4]:
        assert ours.encode(text) == hf.encode(text)
    assert ours.encode("hi")[0] == bos
    # Without a post-processor, the flags decide.
    data = json.loads((path / "tokenizer.json").read_text())
    data["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(data))
    cfg.update(add_bos_token=True, add_eos_token=True)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ids = Tokenizer.from_dir(path).encode("hi")
    assert ids[0] == bos and ids[-1] == eos
    assert ids[1:-1] == Tokenizer.from_dir(path).encode("hi", add_special_tokens=False)
    cfg.update(add_bos_token=False, add_eos_token=False)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(path).encode("hi") == ids[1:-1]


def test_missing_files_give_clear_errors(tmp_path, tok_dirs):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        Tokenizer.from_dir(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=str(empty / "tokenizer.json")):
        Tokenizer.from_dir(empty)
    broken = tmp_path / "broken"
    shutil.copytree(tok_dirs["tiny-llama"], broken)
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(broken)


def test_eos_ids_fallback_to_config(tok_dirs, tmp_path):
    path = tmp_path / "nogen"
    shutil.copytree(tok_dirs["tiny-llama"], path)
    (path / "generation_config.json").unlink()
    assert Tokenizer.from_dir(path).eos_token_ids == (PRESETS["tiny-llama"].eos_token_id,)


def _stream(tok: Tokenizer, ids, **kw) -> list[str]:
    dec = tok.incremental_decoder(**kw)
    deltas = [dec.add(i) for i in ids]
    deltas.append(dec.flush())
    return deltas


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_incremental_decoder_matches_full_decode(tok_dirs, name):
    tok = Tokenizer.from_dir(tok_dirs[name])
    for text in TEXTS + ["".join(TEXTS), "東京🙂" * 20, "ñ" * 7 + "🇳🇴" * 3]:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, ids, skip_special_tokens=False)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == text
        assert "".join(_stream(tok, ids)) == tok.decode(ids)
        assert all("\ufffd" not in d for d in deltas)
        assert deltas[-1] == ""


def test_incremental_decoder_byte_by_byte_emoji(tok_dirs):
    tok = Tokenizer.from_dir(tok_dirs["tiny-llama"])
    # A 4-byte emoji as single-byte tokens: nothing may be emitted before the last byte.
    byte_ids = [tok.token_to_id(t) for t in tok.backend.pre_tokenizer.pre_tokenize_str("🙂")[0][0]]
    assert len(byte_ids) == 4 and None not in byte_ids
    ids = tok.encode("a", add_special_tokens=False) + byte_ids + tok.encode("b", add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    out = [dec.add(i) for i in ids]
    assert out == ["a", "", "", "", "🙂", "b"]
    assert dec.text == "a🙂b" and dec.token_ids == ids
    # Stream ends mid-character: flush releases the replacement character, like full decode.
    dec = IncrementalDecoder(tok)
    assert dec.extend(byte_ids[:2]) == ""
    assert dec.flush() == tok.decode(byte_ids[:2]) == "\ufffd"


def test_incremental_decoder_special_tokens(tok_dirs):
    tok = Tokenizer.from_dir(tok_dirs["tiny-llama"])
    eot = PRESETS["tiny-llama"].special_token_ids["<|eot_id|>"]
    ids = tok.encode("Hi 🙂", add_special_tokens=False) + [eot] + tok.encode(" there", add_special_tokens=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "Hi 🙂 there"
    full = tok.decode(ids, skip_special_tokens=False)
    assert "".join(_stream(tok, ids, skip_special_tokens=False)) == full
    assert "<|eot_id|>" in full
    prompt = tok.encode("Once upon a time")
    gen = tok.encode(" there was a clock.", add_special_tokens=False)
    assert "".join(_stream(tok, gen, prefix_ids=prompt)) == " there was a clock."


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_a_step_decoded_together_equals_each_request_decoded_alone(tok_dirs, name):
    """add_each (one backend call for a step's tokens of every request) gives every decoder the deltas
    and state that add() token by token gives it: split characters, special tokens skipped or kept,
    prompt context, and requests of different lengths in one step."""
    from worker.detokenizer import add_each

    tok = Tokenizer.from_dir(tok_dirs[name])
    eos = tok.eos_token_ids[0]
    texts = [*TEXTS, "東京🙂" * 5, "ñ" * 7 + "🇳🇴" * 3]
    streams = [tok.encode(t, add_special_tokens=False) + [eos] + tok.encode(" end", add_special_tokens=False)
               for t in texts]
    kws = [{"skip_special_tokens": i % 2 == 0, "prefix_ids": tok.encode("Once") if i % 3 == 0 else ()}
           for i in range(len(streams))]
    # both kinds of decoder in one step: the tokenizer's (batched) and the bytes table's
    alone = [IncrementalDecoder(tok, **kw) if i % 2 else tok.incremental_decoder(**kw) for i, kw in enumerate(kws)]
    together = [IncrementalDecoder(tok, **kw) if i % 2 else tok.incremental_decoder(**kw) for i, kw in enumerate(kws)]
    for step in range(max(map(len, streams))):
        live = [i for i, ids in enumerate(streams) if step < len(ids)]
        expected = [alone[i].add(streams[i][step]) for i in live]
        assert add_each([together[i] for i in live], [streams[i][step] for i in live]) == expected
    assert [d.text for d in together] == [d.text for d in alone]
    assert [d.flush() for d in together] == [d.flush() for d in alone]


@pytest.mark.parametrize("name", TINY)
def test_byte_level_decoder_emits_what_the_tokenizer_decoder_emits(tok_dirs, name):
    """The bytes-table decoder (no tokenizer call per token) against IncrementalDecoder, token by token:
    random ids biased to single-byte tokens (characters split across tokens, lone continuation
    bytes, invalid sequences), special tokens skipped and kept, and the flush of a stream that ends
    mid-character."""
    import random

    from worker.detokenizer import ByteLevelDecoder

    tok = Tokenizer.from_dir(tok_dirs[name])
    tables = tok.byte_level_tables
    assert tables is not None, "every preset's tokenizer is byte-level"
    rng = random.Random(name)
    short = [i for i, b in enumerate(tables[False]) if 0 < len(b) <= 2]
    specials = sorted(PRESETS[name].special_token_ids.values())
    for n in range(200):
        ids = [rng.choice(short) if rng.random() < 0.6 else rng.choice(specials) if rng.random() < 0.1
               else rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        skip = n % 2 == 0
        fast, reference = tok.incremental_decoder(skip_special_tokens=skip), IncrementalDecoder(tok, skip)
        assert isinstance(fast, ByteLevelDecoder)
        assert [fast.add(i) for i in ids] == [reference.add(i) for i in ids]
        assert fast.flush() == reference.flush()
        assert fast.text == reference.text == tok.decode(ids, skip_special_tokens=skip)
        assert fast.token_ids == ids


def test_byte_level_decoder_only_where_it_equals_the_tokenizer(tok_dirs):
    """A prompt whose last tokens end mid-character, or a decoder other than ByteLevel alone, keeps
    the tokenizer's own decoding."""
    from tokenizers import decoders

    from worker.detokenizer import ByteLevelDecoder

    tok = Tokenizer.from_dir(tok_dirs["tiny-llama"])
    emoji = [tok.token_to_id(t) for t in tok.backend.pre_tokenizer.pre_tokenize_str("🙂")[0][0]]
    whole = tok.encode("Once upon", add_special_tokens=False)
    assert isinstance(tok.incremental_decoder(prefix_ids=whole), ByteLevelDecoder)
    assert isinstance(tok.incremental_decoder(prefix_ids=whole + emoji), ByteLevelDecoder)
    gen = emoji[:3] + tok.encode(" there 東京", add_special_tokens=False) + emoji[3:] + emoji
    prompt = whole + emoji
    fast, reference = tok.incremental_decoder(prefix_ids=prompt), IncrementalDecoder(tok, prefix_ids=prompt)
    assert [fast.add(i) for i in gen] + [fast.flush()] == [reference.add(i) for i in gen] + [reference.flush()]
    assert type(tok.incremental_decoder(prefix_ids=whole + emoji[:2])) is IncrementalDecoder
    other = Tokenizer.from_dir(tok_dirs["tiny-llama"])
    other.backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert other.byte_level_tables is None
    assert type(other.incremental_decoder()) is IncrementalDecoder
