"""Model presets for random-weight checkpoints: HF config fields, tensor layout, tokenizer family."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CHAT_TEMPLATES",
    "Preset",
    "TensorSpec",
    "TOKENIZER_FAMILIES",
    "TokenizerFamily",
]


from .families import CHAT_TEMPLATES, TOKENIZER_FAMILIES, TokenizerFamily  # noqa: F401 - re-exported


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: HF name, shape and its random init ``N(mean, std)``."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


NORM_STD = 0.1
"""Std of the noise around the (mostly 1.0) RMSNorm weights."""

LOGIT_GAIN = 2.5
"""lm_head std is LOGIT_GAIN / sqrt(hidden): logits get std ~LOGIT_GAIN (peaked, LLM-like)."""
TIED_LOGIT_GAIN = 1.5
"""Smaller gain when lm_head is the embedding, so a token does not mostly predict itself."""

_ARCH_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Preset:
    """A model shape plus the conventions needed to write an HF-format checkpoint.

    Fields mirror HF ``config.json`` keys.  ``special_token_ids`` maps each token of the
    tokenizer family (special and added) to its fixed id; ``generation_eos_token_ids`` is
    what ``generation_config.json`` lists as stop tokens.  ``extra_config`` holds
    architecture-specific config keys written verbatim (e.g. Qwen2's sliding-window flags).
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int
    tokenizer_family: str
    special_token_ids: Mapping[str, int] = field(hash=False)
    generation_eos_token_ids: tuple[int, ...]
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    attention_qkv_bias: bool = False
    qk_norm: bool = False
    extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("special_token_ids", "extra_config", "rope_scaling"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, MappingProxyType(dict(value)))
        if self.architecture not in _ARCH_MODEL_TYPE:
            raise ValueError(f"{self.name}: unsupported architecture {self.architecture!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: num_attention_heads must be a multiple of num_key_value_heads")
        if self.model_type == "qwen2" and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"{self.name}: Qwen2 requires head_dim * num_attention_heads == hidden_size")
        fam = self.family
        if set(self.special_token_ids) != set(fam.all_tokens):
            raise ValueError(f"{self.name}: special_token_ids must cover exactly {fam.all_tokens}")
        ids = list(self.special_token_ids.values())
        if len(set(ids)) != len(ids) or not all(0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"{self.name}: special token ids must be distinct and < vocab_size")
        if self.special_token_ids[fam.eos_token] != self.eos_token_id:
            raise ValueError(f"{self.name}: eos_token_id must be the id of {fam.eos_token}")
        if fam.bos_token is not None and self.special_token_ids[fam.bos_token] != self.bos_token_id:
            raise ValueError(f"{self.name}: bos_token_id must be the id of {fam.bos_token}")
        if not set(self.generation_eos_token_ids) <= set(ids):
            raise ValueError(f"{self.name}: generation eos ids must be special tokens")

    @property
    def model_type(self) -> str:
        """HF ``model_type`` for :attr:`architecture`."""
        return _ARCH_MODEL_TYPE[self.architecture]

    @property
    def family(self) -> TokenizerFamily:
        """The :class:`TokenizerFamily` of this preset."""
        return TOKENIZER_FAMILIES[self.tokenizer_family]

    @property
    def pad_token_id(self) -> int | None:
        """Id of the family's pad token, if it has one."""
        pad = self.family.pad_token
        return None if pad is None else self.special_token_ids[pad]

    @property
    def chat_template(self) -> str:
        """Jinja chat template text of the family."""
        return CHAT_TEMPLATES[self.family.chat_template]

    def config_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The HF ``config.json`` content for this preset with weights stored as ``dtype``."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": float(self.rope_theta),
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "use_cache": True,
            "torch_dtype": dtype,
        }
        if self.model_type != "qwen2":  # Qwen2Config has no head_dim key (always hidden / heads)
            cfg["head_dim"] = self.head_dim
        if self.model_type == "llama":
            cfg.update(attention_bias=self.attention_qkv_bias, mlp_bias=False, pretraining_tp=1)
        elif self.model_type == "qwen3":
            cfg.update(attention_bias=self.attention_qkv_bias)
        cfg.update(dict(self.extra_config))
        return cfg

    def tensor_specs(self) -> list[TensorSpec]:
        """All checkpoint tensors in HF module order (embeddings, layers, final norm, lm_head)."""
        h, hd, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd

        # Linear layers use fan-in init (std 1/sqrt(fan_in), about 0.02 at real widths) so every
        # layer writes O(1) updates into the residual stream and logits stay input-dependent
        # even with tied embeddings. q/k keep unit gain: sqrt(2) made attention sharp enough to
        # double the model's own bf16-vs-fp32 logit error (3.4% -> 1.8% relative L2 at unit gain).
        def lin(fan_in: int, gain: float = 1.0) -> float:
            return gain / math.sqrt(fan_in)

        embed_std = lin(h, TIED_LOGIT_GAIN) if self.tie_word_embeddings else self.initializer_range
        specs = [TensorSpec("model.embed_tokens.weight", (self.vocab_size, h), embed_std)]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            specs.append(TensorSpec(p + "input_layernorm.weight", (h,), NORM_STD, 1.0))
            for proj, out_dim, gain in (
                ("q", q_out, 1.0),
                ("k", kv_out, 1.0),
                ("v", kv_out, 1.0),
            ):
                specs.append(TensorSpec(f"{attn}{proj}_proj.weight", (out_dim, h), lin(h, gain)))
                if self.attention_qkv_bias:
                    specs.append(TensorSpec(f"{attn}{proj}_proj.bias", (out_dim,), 0.1))
            specs.append(TensorSpec(attn + "o_proj.weight", (h, q_out), lin(q_out)))
            if self.qk_norm:
                # Mean 1 per side: normalized q.k scores get std ~1 (as for the q/k gain).
                specs.append(TensorSpec(attn + "q_norm.weight", (hd,), NORM_STD, 1.0))
                specs.append(TensorSpec(attn + "k_norm.weight", (hd,), NORM_STD, 1.0))
            specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), NORM_STD, 1.0))
            specs.append(TensorSpec(p + "mlp.gate_proj.weight", (inter, h), lin(h)))
            specs.append(TensorSpec(p + "mlp.up_proj.weight", (inter, h), lin(h)))
            specs.append(TensorSpec(p + "mlp.down_proj.weight", (h, inter), lin(inter)))
        specs.append(TensorSpec("model.norm.weight", (h,), NORM_STD, 1.0))
        if not self.tie_word_embeddings:
            specs.append(TensorSpec("lm_head.weight", (self.vocab_size, h), lin(h, LOGIT_GAIN)))
        return specs

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        return sum(s.numel for s in self.tensor_specs())
