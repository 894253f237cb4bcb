"""The named presets: tiny checkpoints for tests and real model shapes for benchmarks."""

from __future__ import annotations

from .presets import Preset

__all__ = ["PRESETS", "get_preset"]


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
