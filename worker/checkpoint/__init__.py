"""Random-weight HF-format checkpoints for tests and benchmarks: presets and the writer."""

from .catalog import PRESETS, get_preset
from .presets import Preset, TensorSpec, TokenizerFamily
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
