"""Attention as an opaque torch custom op: where the ``tc_piecewise`` backend splits the graph.

``graphfleet::attention(q, k, v, out, backend, layer)`` writes ``k, v`` into the KV cache and
attention of ``q`` into ``out`` (as vLLM's ``unified_attention_with_output``: the KV write is
inside the op, so compiled pieces never touch the cache). dynamo records it as one node
(its fake implementation says it only mutates ``out``), which :class:`graphs.piecewise.
PiecewiseCompiler` splits at. ``out`` is allocated by the piece before the op, so under a capture
it is a piece output at a fixed graph-pool address that the op fills and the next piece reads.

The op body is an ``@eager_break``: while a piecewise capture records, it ends the current
segment and runs eagerly on every replay with the metadata planned before that replay.
Custom ops take tensors and scalars only, so ``backend`` is a key into a registry of attention
backends (weak: the registry keeps no KV cache alive).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from graphs.breakable import eager_break
from worker.attention.base import AttentionBackend, Rope

_backends: weakref.WeakValueDictionary[int, AttentionBackend] = weakref.WeakValueDictionary()
_keys = itertools.count()


@eager_break
def _attention_break(backend: AttentionBackend, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> None:
    backend.store(layer, k, v)
    backend.attend(layer, q, out)


@torch.library.custom_op("graphfleet::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, backend: int,
              layer: int) -> None:
    """Store ``k, v`` of ``layer`` and write attention of ``q`` into ``out`` (registered backend ``backend``)."""
    _attention_break(_backends[backend], layer, q, k, v, out)


@attention.register_fake
def _attention_fake(q, k, v, out, backend, layer) -> None:
    return None


SPLITTING_OPS = (torch.ops.graphfleet.attention.default,)


class SplittingAttention:
    """Routes a model's attention calls through ``graphfleet::attention`` (the ``run`` seam)."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.key = next(_keys)
        _backends[self.key] = backend
        self.name = f"{backend.name}+split"

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        torch.ops.graphfleet.attention.default(q, k, v, out, self.key, layer)
        return out

    def run_with_rope(self, layer: int, rope: Rope, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # RoPE stays in the compiled piece (inductor fuses it); the op stores and attends.
        q, k = rope.rotate(q, k)
        s, tokens = self.backend.shape, q.shape[0]
        return self.run(layer, q.view(tokens, s.num_q_heads, s.head_dim), k.view(tokens, s.num_kv_heads, s.head_dim),
                        v.view(tokens, s.num_kv_heads, s.head_dim))
