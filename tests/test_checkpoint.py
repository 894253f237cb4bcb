"""Random-weight checkpoint writer: HF transformers loads what we write, bytes are deterministic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from worker.checkpoint import DEFAULT_MAX_SHARD_BYTES, PRESETS, build_tokenizer, get_preset, write_checkpoint

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TINY = ["tiny-llama", "tiny-llama2", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
REAL = ["tinyllama-1.1b", "llama-3.2-1b", "qwen2.5-0.5b", "llama-3-8b"]

# Parameter counts of the public models (tied embeddings counted once).
PUBLIC_PARAM_COUNTS = {
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "llama-3-8b": 8_030_261_248,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``written(preset, dtype="float32", seed=0)`` -> checkpoint dir, written once per module."""
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict = {}

    def make(preset: str, dtype: str = "float32", seed: int = 0):
        key = (preset, dtype, seed)
        if key not in cache:
            cache[key] = write_checkpoint(preset, root / f"{preset}-{dtype}-{seed}", seed=seed, dtype=dtype)
        return cache[key]

    return make


def _hf_model(path, **kw):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def test_preset_table():
    assert set(TINY + REAL) <= set(PRESETS)
    for name in TINY:
        p = PRESETS[name]
        # head_dim 64 everywhere: a size flashinfer's kernels support, so GPU tests run both backends.
        assert p.vocab_size == 1024 and p.head_dim == 64
    q3 = PRESETS["tiny-qwen3"]
    assert q3.head_dim * q3.num_attention_heads != q3.hidden_size
    assert PRESETS["tiny-qwen2"].attention_qkv_bias and PRESETS["tiny-qwen3"].qk_norm
    assert PRESETS["tiny-llama"].config_dict()["rope_scaling"]["rope_type"] == "llama3"
    assert PRESETS["tiny-llama2"].config_dict()["rope_scaling"] is None
    assert get_preset(PRESETS["tiny-llama"]) is PRESETS["tiny-llama"]
    with pytest.raises(KeyError, match="unknown preset 'nope'.*tiny-llama"):
        get_preset("nope")
    with pytest.raises(KeyError):
        write_checkpoint("nope", "/nonexistent/never-created")


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_loads_in_hf(written, name):
    preset = PRESETS[name]
    path = written(name)
    names = {s.name for s in preset.tensor_specs()}
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    )
    assert set(load_file(path / "model.safetensors")) == names
    assert ("lm_head.weight" in names) != preset.tie_word_embeddings

    model = _hf_model(path)
    assert type(model).__name__ == preset.architecture
    assert model.config.vocab_size == preset.vocab_size
    cfg = model.config
    assert (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) == preset.head_dim
    hf_state = model.state_dict()
    ours = load_file(path / "model.safetensors")
    for key, value in ours.items():
        assert torch.equal(hf_state[key], value), key
    if preset.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, ours["model.embed_tokens.weight"])

    ids = torch.tensor([[5, 17, 300, 901, 42, 7, 7, 7], [600, 3, 250, 250, 1000, 8, 99, 12]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 8, preset.vocab_size) and torch.isfinite(logits).all()
    # Non-degenerate: logits vary with the input and across positions, argmax is not constant.
    assert logits.std() > 0.5
    assert not torch.allclose(logits[0, -1], logits[1, -1], atol=0.1)
    assert len(set(logits.argmax(-1).flatten().tolist())) > 4
    changed = ids.clone()
    changed[0, 0] = 77
    with torch.no_grad():
        assert (model(changed).logits[0, -1] - logits[0, -1]).abs().max() > 0.1

    gen = transformers.GenerationConfig.from_pretrained(path)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert tuple(eos) == preset.generation_eos_token_ids
    assert model.config.eos_token_id == preset.eos_token_id


def test_llama3_rope_scaling_changes_frequencies(written):
    model = _hf_model(written("tiny-llama"))
    cfg = model.config
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["rope_theta"] == 500000.0
    scaled = model.model.rotary_emb.inv_freq
    hd = cfg.head_dim
    plain = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    assert not torch.allclose(scaled, plain)
    assert torch.allclose(scaled[0], plain[0])  # high-frequency end untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # low-frequency end divided by factor


def test_qwen3_qk_norm_and_qwen2_bias_weights(written):
    q3 = load_file(written("tiny-qwen3") / "model.safetensors")
    assert q3["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
    assert q3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 64, 128)
    assert "model.layers.0.self_attn.q_proj.bias" not in q3
    q2 = load_file(written("tiny-qwen2") / "model.safetensors")
    for proj in "qkv":
        bias = q2[f"model.layers.1.self_attn.{proj}_proj.bias"]
        assert bias.abs().max() > 0
    assert "model.layers.1.self_attn.o_proj.bias" not in q2
    norm = q2["model.norm.weight"]
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.01


def test_same_seed_same_bytes_different_seed_differs(written, tmp_path):
    a = written("tiny-qwen3")
    b = write_checkpoint("tiny-qwen3", tmp_path / "again", seed=0)
    c = write_checkpoint("tiny-qwen3", tmp_path / "other", seed=1)
    for fname in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / fname).read_bytes() == (b / fname).read_bytes(), fname
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint(written, dtype):
    path = written("tiny-llama", dtype)
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    torch_dtype = getattr(torch, dtype)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            assert f.get_slice(key).get_dtype() == {"bfloat16": "BF16", "float16": "F16"}[dtype]
    half = load_file(path / "model.safetensors")
    full = load_file(written("tiny-llama") / "model.safetensors")
    for key in full:
        assert torch.equal(half[key], full[key].to(torch_dtype)), key
    model = _hf_model(path, dtype=torch_dtype)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 50, 60, 70]])).logits
    assert logits.dtype == torch_dtype and torch.isfinite(logits).all()


def test_sharded_checkpoint(written, tmp_path):
    out = tmp_path / "sharded"
    write_checkpoint("tiny-llama", out, seed=0, shard_size_bytes=300_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted({f for f in index["weight_map"].values()})
    assert len(shard_files) > 2
    assert shard_files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert all(f.endswith(f"-of-{len(shard_files):05d}.safetensors") for f in shard_files)
    assert not (out / "model.safetensors").exists()
    merged: dict = {}
    for fname in shard_files:
        tensors = load_file(out / fname)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 300_000 or len(tensors) == 1
        for key in tensors:
            assert index["weight_map"][key] == fname
        merged.update(tensors)
    single = load_file(written("tiny-llama") / "model.safetensors")
    assert merged.keys() == single.keys() and all(torch.equal(merged[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())

    ids = torch.tensor([[1, 400, 33, 900, 2]])
    with torch.no_grad():
        a = _hf_model(out)(ids).logits
        b = _hf_model(written("tiny-llama"))(ids).logits
    assert torch.equal(a, b)

    # Rewriting unsharded into the same directory removes the stale shards and index.
    write_checkpoint("tiny-llama", out, seed=0)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        write_checkpoint("tiny-llama", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="shard_size_bytes"):
        write_checkpoint("tiny-llama", tmp_path / "y", shard_size_bytes=0)
    with pytest.raises(ValueError, match="seed"):
        write_checkpoint("tiny-llama", tmp_path / "z", seed=-1)


@pytest.mark.parametrize("name", TINY + REAL)
def test_tensor_layout_matches_hf_module_tree(name):
    """Our tensor names/shapes equal HF's parameters for the config (built on the meta device)."""
    preset = PRESETS[name]
    config = transformers.AutoConfig.for_model(**preset.config_dict("bfloat16"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if preset.tie_word_embeddings:
        hf.pop("lm_head.weight")
    ours = {s.name: s.shape for s in preset.tensor_specs()}
    assert ours == hf
    assert preset.num_parameters() == sum(math.prod(s) for s in hf.values())


def checkpoint_nbytes(preset, dtype: str) -> int:
    """Bytes of tensor data in a checkpoint of ``preset`` stored as ``dtype``."""
    return preset.num_parameters() * (4 if dtype == "float32" else 2)


@pytest.mark.parametrize("name", REAL)
def test_real_shape_configs(name):
    preset = PRESETS[name]
    cfg = preset.config_dict("bfloat16")
    config = transformers.AutoConfig.for_model(**cfg)
    assert type(config).__name__ == preset.architecture.replace("ForCausalLM", "Config")
    assert preset.num_parameters() == PUBLIC_PARAM_COUNTS[name]
    assert checkpoint_nbytes(preset, "bfloat16") == 2 * PUBLIC_PARAM_COUNTS[name]
    assert config.num_hidden_layers == cfg["num_hidden_layers"] and config.vocab_size == cfg["vocab_size"]
    assert config.rope_parameters["rope_theta"] == cfg["rope_theta"]
    if cfg["rope_scaling"]:
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == cfg["rope_scaling"]["factor"]
    if preset.architecture == "LlamaForCausalLM":
        assert transformers.LlamaConfig(**cfg).head_dim == preset.head_dim


def test_real_shape_tokenizers_cover_vocab():
    for name in ("llama-3.2-1b", "qwen2.5-0.5b"):
        preset = PRESETS[name]
        tok = build_tokenizer(preset)
        assert tok.get_vocab_size(with_added_tokens=True) == preset.vocab_size
        for token, token_id in preset.special_token_ids.items():
            assert tok.token_to_id(token) == token_id
        last = preset.vocab_size - 1
        assert tok.decode([last]) == f"<|extra_{last}|>"


def test_default_shard_threshold():
    assert DEFAULT_MAX_SHARD_BYTES == 2_000_000_000
    assert checkpoint_nbytes(PRESETS["llama-3-8b"], "bfloat16") > DEFAULT_MAX_SHARD_BYTES


@pytest.mark.slow
def test_write_qwen2_5_0_5b_bf16(tmp_path):
    path = write_checkpoint("qwen2.5-0.5b", tmp_path / "q", dtype="bfloat16")
    assert (path / "model.safetensors").stat().st_size > 2 * PUBLIC_PARAM_COUNTS["qwen2.5-0.5b"]
    model = _hf_model(path, dtype=torch.bfloat16)
    assert model.num_parameters() == PUBLIC_PARAM_COUNTS["qwen2.5-0.5b"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok("Hello there, lighthouse keeper!", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits.float()).all() and logits.shape[-1] == 151936
