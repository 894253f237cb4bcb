"""Write random-weight HF-format checkpoints (weights, configs, trained byte-level BPE tokenizer).

Weights are streamed: every tensor is generated in row chunks from its own seeded
``torch.Generator`` and written straight into a safetensors file whose header is computed up
front, so peak memory is one chunk regardless of model size, and a tensor's bytes depend only
on ``(seed, tensor name, dtype)`` -- not on sharding or write order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from .catalog import get_preset
from .presets import Preset, TensorSpec, TokenizerFamily

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "build_tokenizer",
    "generate_tensor",
    "generation_config_dict",
    "tokenizer_config_dict",
    "write_checkpoint",
    "write_tokenizer",
]

DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
"""Checkpoints larger than this are split into shards of at most this many bytes."""

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_CHUNK_ELEMS = 1 << 24
_MAX_LEARNED_TOKENS = 1 << 16
_WEIGHT_FILE_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def _normalize_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
    return name


def _atomic_write(path: Path, data: bytes | str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _tensor_chunks(spec: TensorSpec, seed: int, dtype: torch.dtype, device: str = "cpu") -> Iterator[torch.Tensor]:
    """Yield ``spec``'s values as consecutive row blocks (dim 0) in ``dtype``, on the CPU.

    ``device`` is where the random numbers are drawn (a CUDA generator is much faster for
    multi-GB checkpoints, and draws different numbers than the CPU one)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_tensor_seed(seed, spec.name))
    rows = spec.shape[0]
    row_numel = spec.numel // rows
    step = max(1, _CHUNK_ELEMS // max(1, row_numel))
    for start in range(0, rows, step):
        block = torch.empty((min(step, rows - start),) + spec.shape[1:], dtype=torch.float32, device=device)
        block.normal_(spec.mean, spec.std, generator=gen)
        yield block.to(dtype).cpu()


def generate_tensor(spec: TensorSpec, seed: int = 0, dtype: str = "float32") -> torch.Tensor:
    """Materialize one tensor exactly as :func:`write_checkpoint` would store it."""
    chunks = list(_tensor_chunks(spec, seed, _TORCH_DTYPES[_normalize_dtype(dtype)]))
    return torch.cat(chunks, dim=0)


def _plan_shards(specs: Sequence[TensorSpec], itemsize: int, limit: int | None) -> list[list[TensorSpec]]:
    if limit is None:
        return [list(specs)]
    if limit <= 0:
        raise ValueError(f"shard_size_bytes must be positive, got {limit}")
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        size = spec.numel * itemsize
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def _write_safetensors(path: Path, specs: Sequence[TensorSpec], seed: int, dtype: str, device: str) -> None:
    torch_dtype = _TORCH_DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        header[spec.name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for spec in specs:
                for chunk in _tensor_chunks(spec, seed, torch_dtype, device):
                    f.write(chunk.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if f.tell() != 8 + len(header_bytes) + offset:
                raise RuntimeError(
                    f"internal error: wrote {f.tell()} bytes to {path}, expected {8 + len(header_bytes) + offset}"
                )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_weights(preset: Preset, out: Path, seed: int, dtype: str, shard_size_bytes: int | None,
                   device: str) -> list[str]:
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; big-endian hosts are not supported")
    specs = preset.tensor_specs()
    itemsize = torch.empty((), dtype=_TORCH_DTYPES[dtype]).element_size()
    total = sum(s.numel for s in specs) * itemsize
    limit = shard_size_bytes
    if limit is None and total > DEFAULT_MAX_SHARD_BYTES:
        limit = DEFAULT_MAX_SHARD_BYTES
    shards = _plan_shards(specs, itemsize, limit)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", shards[0], seed, dtype, device)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for fname, shard in zip(names, shards, strict=True):
        _write_safetensors(out / fname, shard, seed, dtype, device)
        weight_map.update({s.name: fname for s in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _atomic_write(out / "model.safetensors.index.json", _json_text(index))
    return names + ["model.safetensors.index.json"]


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def _pre_tokenizer(split_pattern: str | None) -> pre_tokenizers.PreTokenizer:
    if split_pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@functools.cache
def _train_bpe(
    split_pattern: str | None, nfc: bool, max_tokens: int
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Train byte-level BPE on the bundled corpus; returns (tokens in id order, merges)."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(split_pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = tuple(t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = tuple(tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"])
    return tokens, merges  # type: ignore[return-value]


def _filler(token_id: int) -> str:
    return f"<|extra_{token_id}|>"


@functools.cache
def _tokenizer_json(family: TokenizerFamily, vocab_size: int, special_items: tuple[tuple[str, int], ...]) -> str:
    special_ids = dict(special_items)
    reserved = set(special_ids.values())
    n_free = vocab_size - len(reserved)
    if n_free < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves fewer than 256 ids for the byte alphabet")
    learned, merges = _train_bpe(family.split_pattern, family.nfc_normalize, min(n_free, _MAX_LEARNED_TOKENS))
    free_ids = (i for i in range(vocab_size) if i not in reserved)
    vocab: dict[str, int] = {}
    for token, token_id in zip(learned, free_ids, strict=False):
        vocab[token] = token_id
    for token, token_id in special_ids.items():
        if token in vocab:
            raise ValueError(f"special token {token!r} collides with a learned BPE token")
        vocab[token] = token_id
    for token_id in free_ids:
        vocab[_filler(token_id)] = token_id
    if len(vocab) != vocab_size:
        raise RuntimeError("internal error: tokenizer vocabulary does not cover every id exactly once")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False))
    if family.nfc_normalize:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(family.split_pattern)
    tok.decoder = decoders.ByteLevel()
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    if family.add_bos_token:
        bos = family.bos_token
        assert bos is not None
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, special_ids[bos])],
            )
        )
    tok.post_processor = processors.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added_tokens])
    for token, token_id in special_ids.items():
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"internal error: {token!r} got id {tok.token_to_id(token)}, expected {token_id}")
    return tok.to_str()


def build_tokenizer(preset: str | Preset) -> Tokenizer:
    """Build the preset's tokenizer: byte-level BPE trained on the bundled corpus, its family's
    special tokens at the preset's ids, and ``<|extra_N|>`` fillers so the vocabulary has exactly
    ``vocab_size`` entries.  Deterministic; training is cached per process."""
    p = get_preset(preset)
    items = tuple(sorted(p.special_token_ids.items(), key=lambda kv: kv[1]))
    return Tokenizer.from_str(_tokenizer_json(p.family, p.vocab_size, items))


def tokenizer_config_dict(preset: str | Preset) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content for ``preset`` (includes its ``chat_template``)."""
    p = get_preset(preset)
    fam = p.family
    special = set(fam.special_tokens)
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in special,
        }
        for token, token_id in sorted(p.special_token_ids.items(), key=lambda kv: kv[1])
    }
    cfg: dict[str, Any] = {
        "add_bos_token": fam.add_bos_token,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": fam.bos_token,
        "eos_token": fam.eos_token,
        "pad_token": fam.pad_token,
        "chat_template": p.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": p.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if fam.unk_token is not None:
        cfg["unk_token"] = fam.unk_token
    return cfg


def write_tokenizer(preset: str | Preset, out_dir: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``preset`` into ``out_dir``."""
    p = get_preset(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = tuple(sorted(p.special_token_ids.items(), key=lambda kv: kv[1]))
    _atomic_write(out / "tokenizer.json", _tokenizer_json(p.family, p.vocab_size, items))
    _atomic_write(out / "tokenizer_config.json", _json_text(tokenizer_config_dict(p)))
    return out


# ----------------------------------------------------------------------------------------------
# Checkpoint
# ----------------------------------------------------------------------------------------------


def generation_config_dict(preset: str | Preset) -> dict[str, Any]:
    """The ``generation_config.json`` content (bos/pad ids and the stop-token ids)."""
    p = get_preset(preset)
    eos = list(p.generation_eos_token_ids)
    cfg: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if p.bos_token_id is not None:
        cfg["bos_token_id"] = p.bos_token_id
    if p.pad_token_id is not None:
        cfg["pad_token_id"] = p.pad_token_id
    return cfg


def write_checkpoint(
    preset: str | Preset,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    shard_size_bytes: int | None = None,
    device: str = "cpu",
) -> Path:
    """Write a random-weight HF checkpoint of ``preset`` into ``out_dir`` and return its path.

    Files: ``config.json``, ``generation_config.json``, ``tokenizer.json``,
    ``tokenizer_config.json`` and either ``model.safetensors`` or
    ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``.  Sharding happens
    when the data exceeds ``shard_size_bytes`` (default: :data:`DEFAULT_MAX_SHARD_BYTES`).
    ``dtype`` is ``"float32"``, ``"bfloat16"`` or ``"float16"``.  The same ``(preset, seed,
    dtype)`` always yields identical bytes; ``device="cuda"`` draws the random weights on the GPU
    (fast for multi-GB presets; identical bytes per ``(preset, seed, dtype, device)``).
    Weight files of an earlier write that this one
    does not produce (e.g. old shards) are removed from ``out_dir``.
    """
    p = get_preset(preset)
    dtype = _normalize_dtype(dtype)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = set(_write_weights(p, out, seed, dtype, shard_size_bytes, device))
    for stale in out.iterdir():
        if _WEIGHT_FILE_RE.match(stale.name) and stale.name not in written:
            stale.unlink()
    _atomic_write(out / "config.json", _json_text(p.config_dict(dtype)))
    _atomic_write(out / "generation_config.json", _json_text(generation_config_dict(p)))
    write_tokenizer(p, out)
    return out
