"""Random-weight HF-format checkpoints for tests and benchmarks: presets and the writer."""

from .presets import PRESETS, Preset, TensorSpec, TokenizerFamily, get_preset
from .writer import DEFAULT_MAX_SHARD_BYTES, build_tokenizer, write_checkpoint, write_tokenizer

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "PRESETS",
    "Preset",
    "TensorSpec",
    "TokenizerFamily",
    "build_tokenizer",
    "get_preset",
    "write_checkpoint",
    "write_tokenizer",
]
