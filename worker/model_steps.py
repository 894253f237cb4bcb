"""Our model seen through the graph runtime's step protocols (``graphs.decode.DecodeStep``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from graphs.piecewise import PiecewiseCompiled
from worker.attention.base import AttentionBackend, AttentionBatch
from worker.attention.breaking import BreakingAttention
from worker.attention.splitting import SPLITTING_OPS, SplittingAttention
from worker.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class _ModelStep:
    """A model and its attention backend as one phase's graph step.

    ``breakable=True`` routes attention through eager breaks (:class:`BreakingAttention`);
    otherwise attention is recorded in the graph, and backends with CUDA-graph wrappers
    (flashinfer) get one per captured shape.
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, breakable: bool) -> None:
        self.model = model
        self.attention = attention
        self.breakable = breakable
        self.device = model.device
        self._forward_attention = BreakingAttention(attention) if breakable else attention

    def _graph_wrapper(self, *shape) -> None:
        if not self.breakable and hasattr(self.attention, "graph_wrapper"):
            self.attention.graph_wrapper(*shape)


class ModelDecodeStep(_ModelStep):
    """Decode step (body and LM head) of a :class:`LlamaForCausalLM`."""

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, breakable: bool) -> None:
        super().__init__(model, attention, breakable)
        self.vocab_size = model.arch.vocab_size

    def plan(self, attention: AttentionBatch, padded_rows: int) -> None:
        """Plan the live rows of ``attention`` and padding rows (length 1, dummy page) up to ``padded_rows``."""
        self.attention.plan(attention, padded_rows)

    def plan_dummy(self, rows: int) -> None:
        """Plan ``rows`` padding rows (warm-up and capture of the ``rows`` shape)."""
        self._graph_wrapper(False, rows)
        self.attention.plan(AttentionBatch.decode([], []), rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the runner's copy into its float32 output is the cast (one
        kernel, no float32 intermediate in the graph pool)."""
        hidden = self.model(input_ids, positions, self._forward_attention)
        return self.model.compute_logits(hidden, dtype=None)


class CompiledDecodeStep(ModelDecodeStep):
    """Decode step for the ``tc_full`` backend: the body under ``torch.compile(fullgraph=True)``,
    split at the attention custom op (:mod:`worker.attention.splitting`), pieces compiled by
    ``compiler``; the backend records pieces and ops into one full graph per shape.

    One compile serves every batch of two rows or more; batch 1 compiles once more (dynamo
    specializes sizes 0 and 1). :class:`graphs.backends.TcFullBackend` runs each shape once
    outside the graph pool before its warm-ups, so both compiles allocate outside it.

    A compile that fails is not fatal: the step logs it, calls ``on_compile_failure(reason)``
    once, and from then on runs the uncompiled forward, so the backend captures what ``full``
    would. Build one per model and attention backend and reuse it (dynamo's caches are per code
    object, process-wide: see :mod:`graphs.piecewise`).
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, compiler: str = "inductor") -> None:
        super().__init__(model, attention, breakable=False)
        self.compiled = PiecewiseCompiled(self._traced_forward, SPLITTING_OPS, compiler)
        self._splitting = SplittingAttention(attention)
        self.compile_error: str | None = None
        self.on_compile_failure: Callable[[str], None] | None = None

    def _traced_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._splitting)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.compile_error is None:
            try:
                return self.model.compute_logits(self.compiled(input_ids, positions), dtype=None)
            except torch._dynamo.exc.TorchDynamoException as e:  # a failed compile: the plain forward
                self.compile_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.error("torch.compile of the decode forward failed; decode graphs capture the uncompiled "
                          "forward (as graphs.decode.backend=full): %s", self.compile_error)
                if self.on_compile_failure is not None:
                    self.on_compile_failure(self.compile_error)
        return super().forward(input_ids, positions)


class ModelPrefillStep(_ModelStep):
    """Prefill step of a :class:`LlamaForCausalLM`: the body, and the LM head for a runner whose
    graphs end in logits.

    Recording attention in the graph (``breakable=False``) needs a backend whose prefill
    attention is graph-safe (flashinfer); breakable runs it, and its host-dependent work, eagerly.
    ``mlp_chunk_tokens``: the MLP runs over row chunks of at most that many tokens
    (:meth:`worker.model.llama.MLP.forward`; ``graphs.prefill.mlp_chunk_tokens``).
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, breakable: bool,
                 mlp_chunk_tokens: int | None = None) -> None:
        if not breakable and not attention.graph_safe(True):
            raise ValueError(f"graphs.prefill.backend=full needs a graph-safe prefill attention backend; "
                             f"attention.backend={attention.name} is not (use graphs.prefill.backend=breakable)")
        super().__init__(model, attention, breakable)
        self.mlp_chunk_tokens = mlp_chunk_tokens
        self.hidden_size = model.arch.hidden_size
        self.vocab_size = model.arch.vocab_size

    def plan(self, attention: AttentionBatch, tokens: int, slots: int) -> None:
        """Plan ``attention`` in ``slots`` rows and ``tokens`` tokens: unused rows are zero-length
        sentinels (their offsets sit after the real tokens; they read and write nothing) and tokens
        past the real ones are tail padding whose KV goes to the dummy page."""
        self.attention.plan(attention, slots, tokens)

    def plan_dummy(self, tokens: int, slots: int) -> None:
        """Plan a capture batch: one row of ``tokens`` tokens on the dummy page, then sentinels."""
        self._graph_wrapper(True, slots, tokens)
        self.attention.plan(AttentionBatch.dummy_prefill(tokens, self.attention.kv_cache.page_size), slots, tokens)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._forward_attention, self.mlp_chunk_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head in the model's dtype: the runner's copy into its float32 output is the cast."""
        return self.model.compute_logits(hidden, dtype=None)


class CompiledPrefillStep(ModelPrefillStep):
    """Prefill step for the ``tc_piecewise`` backend: the body under ``torch.compile(fullgraph=True)``,
    split at the attention custom op (:mod:`worker.attention.splitting`), pieces compiled by
    ``compiler`` (``inductor`` or ``eager``).

    One compile (symbolic token count) serves every bucket. Build one per model and attention
    backend and reuse it (see :mod:`graphs.piecewise` on dynamo's process-wide caches). On CUDA,
    flashinfer's fused element-wise kernels are traced as their PyTorch equivalents, which
    inductor fuses (vLLM likewise compiles native ops instead of its custom kernels).
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, compiler: str = "inductor") -> None:
        super().__init__(model, attention, breakable=True)
        self._forward_attention = SplittingAttention(attention)
        self.compiled = PiecewiseCompiled(self._traced_forward, SPLITTING_OPS, compiler)

    def _traced_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._forward_attention)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.compiled(input_ids, positions)
