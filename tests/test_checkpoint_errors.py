"""Broken checkpoints and configs fail with messages that name the tensor, field or key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model.arch import CheckpointError
from worker.model.loader import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy", "--log-level", "ERROR", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_missing_tensor_named(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir("tiny-llama"), tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_model(path, torch.float32, torch.device("cpu"))
    res = _cli("generate", "--model", str(path), "--prompt-ids", "1,2,3")
    assert res.returncode == 2
    assert "model.layers.2.mlp.up_proj.weight" in res.stderr and "Traceback" not in res.stderr


def test_wrong_shape_named_with_expected(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir("tiny-llama"), tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight", torch.zeros(32, 256)))
    with pytest.raises(CheckpointError) as err:
        load_model(path, torch.float32, torch.device("cpu"))
    msg = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "[32, 256]" in msg and "expected [128, 256]" in msg


@pytest.mark.parametrize("field,value,pattern", [
    ("architectures", ["GPT2LMHeadModel"], r"'architectures' is \['GPT2LMHeadModel'\]; supported: .*LlamaForCausalLM"),
    ("hidden_act", "gelu", r"'hidden_act' is 'gelu'; supported: 'silu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, r"'rope_scaling.rope_type' is 'yarn'"),
])
def test_unsupported_config_named(checkpoint_dir, tmp_path, field, value, pattern):
    path = _copy(checkpoint_dir("tiny-llama"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(path, torch.float32, torch.device("cpu"))
    res = _cli("generate", "--model", str(path), "--prompt-ids", "1,2,3")
    assert res.returncode == 2 and field in res.stderr and "Traceback" not in res.stderr


def test_missing_config_field_named(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir("tiny-llama"), tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing field 'intermediate_size'"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_config_typo_via_cli_named(checkpoint_dir, tmp_path):
    path = checkpoint_dir("tiny-llama")
    res = _cli("generate", "--model", str(path), "--prompt-ids", "1,2,3", "--set", "scheduler.max_runing_requests=4")
    assert res.returncode == 2
    assert "scheduler.max_runing_requests" in res.stderr and "max_running_requests" in res.stderr
    assert "Traceback" not in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  page_sise: 16\n")
    res = _cli("generate", "--model", str(path), "--prompt-ids", "1,2,3", "--config", str(bad))
    assert res.returncode == 2 and "cache.page_sise" in res.stderr and "page_size" in res.stderr


def test_sharded_checkpoint_loads_same_weights(checkpoint_dir, tmp_path):
    from worker.checkpoint import write_checkpoint

    single = checkpoint_dir("tiny-qwen2")
    sharded = write_checkpoint("tiny-qwen2", tmp_path / "sharded", seed=0, dtype="float32", shard_size_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, _ = load_model(single, torch.float32, torch.device("cpu"))
    b, _ = load_model(sharded, torch.float32, torch.device("cpu"))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
