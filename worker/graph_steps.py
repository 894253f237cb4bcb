"""Our model seen through the graph runtime's step protocols (``graphs.decode.DecodeStep``)."""

from __future__ import annotations

import torch

from worker.attention.base import AttentionBackend, AttentionBatch
from worker.attention.breaking import BreakingAttention
from worker.kv_cache import PagedKVCache
from worker.model.llama import LlamaForCausalLM


def pad_decode_batch(batch: AttentionBatch, rows: int) -> AttentionBatch:
    """``batch`` plus padding rows (length 1, dummy page) up to ``rows``."""
    pad = rows - batch.num_rows
    if pad < 0:
        raise ValueError(f"cannot pad a batch of {batch.num_rows} rows to {rows}")
    dummy = [PagedKVCache.DUMMY_PAGE]
    return AttentionBatch(False, batch.seq_lens + [1] * pad, batch.query_lens + [1] * pad,
                          batch.page_tables + [dummy] * pad, rows)


class ModelDecodeStep:
    """Decode step of a :class:`LlamaForCausalLM` over an attention backend.

    ``breakable=True`` routes attention through eager breaks; otherwise attention runs inside
    the graph, and backends with CUDA-graph wrappers (flashinfer) get one per captured size.
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, breakable: bool) -> None:
        self.model = model
        self.attention = attention
        self.breakable = breakable
        self.vocab_size = model.arch.vocab_size
        self.device = model.device
        self._forward_attention = BreakingAttention(attention) if breakable else attention

    def plan(self, attention: AttentionBatch, padded_rows: int) -> None:
        self.attention.plan(pad_decode_batch(attention, padded_rows))

    def plan_dummy(self, rows: int) -> None:
        if not self.breakable and hasattr(self.attention, "graph_wrapper"):
            self.attention.graph_wrapper(False, rows)
        self.attention.plan(pad_decode_batch(AttentionBatch.decode([], []), rows))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self._forward_attention)
        return self.model.compute_logits(hidden)
