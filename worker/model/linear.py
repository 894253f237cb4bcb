"""Linear layers behind one abstraction, so tensor parallelism changes loading, not layers.

Each layer owns a local weight ``(out_local, in_local)`` and knows which slice of which
checkpoint tensors fills it. With ``tp.size == 1`` every layer holds the full tensor and no
collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.parallel import TensorParallel
from worker.model.weights import SafetensorsCheckpoint


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor stacked along the output dim: ``rows`` is its full output size."""

    name: str
    rows: int
    start: int
    length: int


class Linear(nn.Module):
    """``y = x W^T (+ b)`` on this rank's weight shard; subclasses decide the sharding."""

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_local, self.out_local = in_local, out_local
        self.weight = _param((out_local, in_local), dtype)
        self.bias = _param((out_local,), dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output dim sharded; several checkpoint tensors may be stacked (merged QKV, gate/up).

    ``sources`` lists, per stacked tensor, the rows this rank takes; the input dim is full.
    """

    def __init__(self, in_features: int, sources: list[Source], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(s.length for s in sources), bias, dtype)
        self.sources = sources
        self.in_features = in_features

    def load(self, ckpt: SafetensorsCheckpoint) -> None:
        offset = 0
        for s in self.sources:
            w = ckpt.read(s.name + ".weight", (s.rows, self.in_features), dim=0, start=s.start, length=s.length)
            self.weight.data[offset:offset + s.length].copy_(w)
            if self.bias is not None:
                b = ckpt.read(s.name + ".bias", (s.rows,), dim=0, start=s.start, length=s.length)
                self.bias.data[offset:offset + s.length].copy_(b)
            offset += s.length


class RowParallelLinear(Linear):
    """Input dim sharded; partial outputs summed by an all-reduce over the TP group."""

    def __init__(self, name: str, in_features: int, out_features: int, tp: TensorParallel,
                 dtype: torch.dtype) -> None:
        self.in_start, in_local = tp.shard(in_features, f"{name} input size")
        super().__init__(in_local, out_features, False, dtype)
        self.name, self.in_features, self.tp = name, in_features, tp

    def load(self, ckpt: SafetensorsCheckpoint) -> None:
        w = ckpt.read(self.name + ".weight", (self.out_local, self.in_features), dim=1,
                      start=self.in_start, length=self.in_local)
        self.weight.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def partial_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's product of ``x`` written into ``out`` (contiguous rows), not yet summed over
        the TP group: the caller all-reduces the whole output once."""
        torch.mm(x, self.weight.t(), out=out)


def qkv_sources(prefix: str, num_heads: int, num_kv_heads: int, head_dim: int,
                tp: TensorParallel) -> tuple[list[Source], int, int]:
    """Sources of a merged QKV projection and the local (q_heads, kv_heads).

    KV heads are sharded when ``tp.size <= num_kv_heads`` and replicated otherwise (each rank
    keeps the one KV head its query heads read).
    """
    q_start, q_heads = tp.shard(num_heads, "num_attention_heads")
    if tp.size <= num_kv_heads:
        kv_start, kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
    else:
        if tp.size % num_kv_heads:
            raise ValueError(f"tp_size={tp.size} must be a multiple of num_key_value_heads={num_kv_heads}")
        kv_heads, kv_start = 1, tp.rank * num_kv_heads // tp.size
    sources = [
        Source(f"{prefix}.q_proj", num_heads * head_dim, q_start * head_dim, q_heads * head_dim),
        Source(f"{prefix}.k_proj", num_kv_heads * head_dim, kv_start * head_dim, kv_heads * head_dim),
        Source(f"{prefix}.v_proj", num_kv_heads * head_dim, kv_start * head_dim, kv_heads * head_dim),
    ]
    return sources, q_heads, kv_heads


class VocabParallelEmbedding(nn.Module):
    """Embedding rows sharded by vocabulary; out-of-shard ids contribute zeros, then all-reduce."""

    def __init__(self, name: str, vocab_size: int, hidden: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.name, self.vocab_size, self.hidden, self.tp = name, vocab_size, hidden, tp
        per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * per_rank
        self.vocab_local = max(0, min(per_rank, vocab_size - self.vocab_start))
        self.weight = _param((per_rank, hidden), dtype)

    def load(self, ckpt: SafetensorsCheckpoint) -> None:
        w = ckpt.read(self.name, (self.vocab_size, self.hidden), dim=0,
                      start=self.vocab_start, length=self.vocab_local)
        self.weight.data.zero_()
        self.weight.data[: self.vocab_local].copy_(w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Full-vocabulary logits with this weight as the LM head, in ``dtype`` (None: the weight's,
        as the GEMM rounds them; a later cast to float32 gives the same values as ``dtype=float32``).
        Shards are gathered before the cast, in the narrower dtype."""
        full = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))[..., : self.vocab_size]
        return full if dtype is None or full.dtype == dtype else full.to(dtype)
