"""Build a :class:`LlamaForCausalLM` from a checkpoint directory."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from worker.model.arch import ModelArch, load_arch
from worker.model.kernels import Kernels
from worker.model.llama import LlamaForCausalLM
from worker.model.parallel import SINGLE, TensorParallel
from worker.model.weights import SafetensorsCheckpoint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               tp: TensorParallel = SINGLE, kernels: Kernels | None = None,
               max_positions: int | None = None) -> tuple[LlamaForCausalLM, ModelArch]:
    """Read ``config.json`` and this rank's weight shards; returns the model in eval mode."""
    start = time.perf_counter()
    arch = load_arch(model_dir)
    ckpt = SafetensorsCheckpoint(model_dir)
    model = LlamaForCausalLM(arch, dtype, device, tp, kernels, max_positions)
    model.load(ckpt)
    unused = [n for n in ckpt.unused() if not n.endswith("rotary_emb.inv_freq")]
    if tp.size == 1 and unused:
        log.warning("%s: %d checkpoint tensors unused, e.g. %s", model_dir, len(unused), unused[:3])
    ckpt.close()
    model.eval()
    n = arch.num_parameters()
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    log.info("loaded %s (%s, %s params) as %s on %s in %.1fs", Path(model_dir).name, arch.architecture,
             size, str(dtype).removeprefix("torch."), device, time.perf_counter() - start)
    return model, arch


def resolve_device(name: str) -> torch.device:
    """``auto`` is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("model.device=cuda but CUDA is not available; use model.device=auto or cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def checkpoint_max_len(arch: ModelArch, limit: int | None) -> int:
    """The longest sequence the checkpoint and ``limit`` (``model.max_model_len``) allow (before cache size)."""
    max_len = arch.max_position_embeddings
    if arch.sliding_window and arch.sliding_window < max_len:
        log.warning("sliding_window=%d: capping max_model_len to it (sliding attention is not "
                    "implemented; within the window it equals full attention)", arch.sliding_window)
        max_len = arch.sliding_window
    if limit is not None:
        if limit > max_len:
            raise ValueError(f"model.max_model_len={limit} exceeds the checkpoint's limit {max_len}")
        max_len = limit
    return max_len
