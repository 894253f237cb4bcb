"""A checkpoint's ``config.json`` turned into one validated, typed architecture description."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file, field or tensor."""


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArch:
    """Everything the decoder needs to know about a checkpoint's shapes."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * layer + v * h + h + head


def _require(cfg: dict[str, Any], key: str, path: Path, kind: type = int) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{path}: missing field '{key}'")
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{path}: field '{key}' must be {kind.__name__}, got {value!r}")
    if kind is int and value <= 0:
        raise CheckpointError(f"{path}: field '{key}' must be > 0, got {value}")
    return value


def _rope_scaling(cfg: dict[str, Any], path: Path) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rs is None:
        return None
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise CheckpointError(
            f"{path}: field 'rope_scaling.rope_type' is {rope_type!r}; supported: 'llama3', 'default'"
        )
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: field 'rope_scaling.{e.args[0]}' is required for llama3 scaling") from None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_arch(model_dir: str | Path) -> ModelArch:
    """Read and validate ``config.json`` (and ``generation_config.json`` for EOS ids)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a checkpoint directory needs config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: field 'architectures' is {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    family = SUPPORTED_ARCHITECTURES[arch]
    hidden = _require(cfg, "hidden_size", path)
    heads = _require(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = cfg.get("head_dim") or hidden // heads
    sliding = cfg.get("sliding_window")
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None
    if family == "llama" and cfg.get("attention_bias", False):
        raise CheckpointError(f"{path}: field 'attention_bias' is true; Llama with attention bias is not supported")
    if cfg.get("mlp_bias", False):
        raise CheckpointError(f"{path}: field 'mlp_bias' is true; supported: false")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: field 'hidden_act' is {act!r}; supported: 'silu'")
    eos = _eos_ids(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = _eos_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        eos = gen_eos or eos
    return ModelArch(
        architecture=arch,
        family=family,
        vocab_size=_require(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size", path),
        num_layers=_require(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg, path),
        max_position_embeddings=_require(cfg, "max_position_embeddings", path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
    )
