"""Model presets for random-weight checkpoints: HF config fields, tensor layout, tokenizer family."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CHAT_TEMPLATES",
    "PRESETS",
    "Preset",
    "TensorSpec",
    "TOKENIZER_FAMILIES",
    "TokenizerFamily",
    "get_preset",
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

    def checkpoint_nbytes(self, dtype: str = "float32") -> int:
        """Bytes of tensor data in a checkpoint stored as ``dtype``."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        return self.num_parameters() * (4 if dtype == "float32" else 2)


def _llama3_ids(bos: int, eos: int, start: int, end: int, eot: int, pad: int) -> dict[str, int]:
    return {
        "<|begin_of_text|>": bos,
        "<|end_of_text|>": eos,
        "<|start_header_id|>": start,
        "<|end_header_id|>": end,
        "<|eot_id|>": eot,
        "<|finetune_right_pad_id|>": pad,
    }


_SP_IDS = {"<unk>": 0, "<s>": 1, "</s>": 2}

_LLAMA3_SCALING_TINY = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _presets() -> dict[str, Preset]:
    tiny_qwen_ids = {"<|endoftext|>": 1021, "<|im_start|>": 1022, "<|im_end|>": 1023}
    real_qwen_ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    presets = [
        Preset(
            name="tiny-llama",
            architecture="LlamaForCausalLM",
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=2048,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_SCALING_TINY,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            tokenizer_family="llama3",
            special_token_ids=_llama3_ids(bos=1, eos=2, start=3, end=4, eot=5, pad=0),
            generation_eos_token_ids=(2, 5),
        ),
        Preset(
            name="tiny-llama2",
            architecture="LlamaForCausalLM",
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=1024,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            tokenizer_family="llama2",
            special_token_ids=_SP_IDS,
            generation_eos_token_ids=(2,),
        ),
        Preset(
            name="tiny-qwen2",
            architecture="Qwen2ForCausalLM",
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=640,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=1021,
            eos_token_id=1021,
            attention_qkv_bias=True,
            tokenizer_family="qwen2",
            special_token_ids=tiny_qwen_ids,
            generation_eos_token_ids=(1023, 1021),
            extra_config={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 4},
        ),
        Preset(
            name="tiny-qwen3",
            architecture="Qwen3ForCausalLM",
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=1019,
            eos_token_id=1019,
            qk_norm=True,
            tokenizer_family="qwen3",
            special_token_ids={
                "<|endoftext|>": 1019,
                "<|im_start|>": 1020,
                "<|im_end|>": 1021,
                "<think>": 1022,
                "</think>": 1023,
            },
            generation_eos_token_ids=(1021, 1019),
            extra_config={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 4},
        ),
        Preset(
            name="tiny-mistral",
            architecture="MistralForCausalLM",
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            tokenizer_family="mistral",
            special_token_ids=_SP_IDS,
            generation_eos_token_ids=(2,),
            extra_config={"sliding_window": None},
        ),
        # Real shapes (public configs).
        Preset(
            name="tinyllama-1.1b",
            architecture="LlamaForCausalLM",
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            tokenizer_family="tinyllama",
            special_token_ids=_SP_IDS,
            generation_eos_token_ids=(2,),
        ),
        Preset(
            name="llama-3.2-1b",
            architecture="LlamaForCausalLM",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=128001,
            tokenizer_family="llama3",
            special_token_ids=_llama3_ids(128000, 128001, 128006, 128007, 128009, 128004),
            generation_eos_token_ids=(128001, 128009),
        ),
        Preset(
            name="qwen2.5-0.5b",
            architecture="Qwen2ForCausalLM",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
            attention_qkv_bias=True,
            tokenizer_family="qwen2",
            special_token_ids=real_qwen_ids,
            generation_eos_token_ids=(151645, 151643),
            extra_config={"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24},
        ),
        Preset(
            name="llama-3-8b",
            architecture="LlamaForCausalLM",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
            tokenizer_family="llama3",
            special_token_ids=_llama3_ids(128000, 128001, 128006, 128007, 128009, 128004),
            generation_eos_token_ids=(128001, 128009),
        ),
    ]
    return {p.name: p for p in presets}


PRESETS: dict[str, Preset] = _presets()


def get_preset(name: str | Preset) -> Preset:
    """Return the preset called ``name`` (a :class:`Preset` is returned unchanged)."""
    if isinstance(name, Preset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
