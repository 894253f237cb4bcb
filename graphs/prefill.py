"""The prefill runner: token buckets times a fixed number of request slots.

Each captured shape holds ``bucket`` tokens and ``slots`` request rows. A live prefill batch of
``n`` tokens from ``r <= slots`` requests fills tokens ``[0, n)`` and rows ``[0, r)``; rows
``[r, slots)`` are rewritten on every replay as zero-length sentinels (sequence and query
length 0, no pages, offsets parked after the real tokens) and tokens ``[n, bucket)`` are padding
whose KV goes to the dummy page. The graph computes final hidden states and keeps only the rows
the step samples (``LivePrefillBatch.rows``, at most one a request slot), so padded rows never
reach logits or sampling, and no ``(tokens, hidden)`` buffer outlives the graph's own activations.

The output is those rows' hidden states ``(slots, hidden)``, or with ``logits=True`` their logits
``(slots, vocab)`` float32: the step's LM head then runs inside the graph too (on every slot: a
sentinel's row is token 0's, computed and never read), so no eager GEMM follows a replay. That
output may be a view of a buffer the runner does not own (``logits_out``: the decode runner's
static logits, whose steps never overlap a prefill's), so prefill adds no logits buffer of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphs.backends import GraphBackend
from graphs.buckets import BucketChoice, choose_bucket
from graphs.metrics import GraphMetrics
from graphs.runner import GraphRunner
from graphs.tokens import StaticTokens


def default_prefill_ladder(ceiling: int, smallest: int = 64) -> list[int]:
    """About 40 token buckets up to ``ceiling`` (always included).

    Steps of ``smallest`` up to 1024 tokens, then an eighth of the current power of two
    (128 up to 2048, 256 up to 4096, 512 up to 8192, ...): relative padding stays under ~12%.
    """
    if ceiling < 1:
        raise ValueError(f"prefill ceiling must be >= 1, got {ceiling}")
    ladder, t = [], min(smallest, ceiling)
    while t < ceiling:
        ladder.append(t)
        power = 1 << (t.bit_length() - 1)
        t += max(smallest, power // 8)
    ladder.append(ceiling)
    return ladder


#: The largest float32 logits buffer prefill graphs take for themselves: the cuBLAS workspace (32 MiB
#: on Hopper) that an eager LM head after every replay would add on the step's stream.
HEAD_BUFFER_LIMIT = 32 * 2**20


def logits_output(shared: torch.Tensor | None, slots: int, vocab: int) -> tuple[bool, torch.Tensor | None]:
    """Where a prefill runner's graphs put the LM head: ``(logits, logits_out)`` for
    :class:`PrefillGraphRunner`. Into ``shared`` (the decode runner's static float32 logits) when it
    has a row for every slot; else into a buffer of the runner's own when that is at most
    :data:`HEAD_BUFFER_LIMIT`; else not at all (hidden states out, the head eager after a replay)."""
    if shared is not None and shared.shape[0] >= slots:
        return True, shared
    return slots * vocab * 4 <= HEAD_BUFFER_LIMIT, None


class PrefillStep(Protocol):
    """What a model offers the prefill runner (implemented on the worker side)."""

    hidden_size: int
    device: torch.device

    def plan(self, attention: Any, tokens: int, slots: int) -> None:
        """Host side: plan the live rows of ``attention`` padded to ``slots`` rows and ``tokens`` tokens."""

    def plan_dummy(self, tokens: int, slots: int) -> None:
        """Host side: plan a capture batch of ``tokens`` tokens in ``slots`` rows."""

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Device side: (tokens,) ids and positions -> (tokens, hidden) final hidden states."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Device side (runners with ``logits=True``): (rows, hidden) -> (rows, vocab) logits, float32
        or a narrower float type that the float32 output holds exactly (its copy is the cast)."""


@dataclass
class LivePrefillBatch:
    """One prefill step: flat tokens of ``num_requests`` requests and their attention batch.

    ``rows``: int64 indices (on the device) of the tokens whose final hidden states the step needs
    (the last token of each request that samples); None: none (the step only writes KV).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: Any
    num_requests: int
    rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return 0 if self.rows is None else self.rows.shape[0]


@dataclass
class PrefillBuffers:
    """Static inputs and the one output of the prefill runner, shared by every shape."""

    tokens: StaticTokens  # (max_tokens,) ids and positions
    rows: torch.Tensor  # (slots,) int64 token indices to keep; unused entries 0
    out: torch.Tensor  # (slots, hidden) final hidden states of those tokens, or (slots, vocab) float32 logits

    @classmethod
    def allocate(cls, max_tokens: int, slots: int, out: torch.Tensor, device: torch.device) -> PrefillBuffers:
        return cls(StaticTokens.allocate(max_tokens, device), torch.zeros(slots, dtype=torch.int64, device=device),
                   out)


class PrefillGraphRunner(GraphRunner[LivePrefillBatch, torch.Tensor]):
    """Pads live prefill batches to captured token buckets with fixed request slots."""

    phase = "prefill"

    def __init__(self, step: PrefillStep, backend: GraphBackend, ladder: list[int], slots: int,
                 max_padding_ratio: float = 2.0, metrics: GraphMetrics | None = None,
                 dtype: torch.dtype = torch.bfloat16, logits: bool = False,
                 logits_out: torch.Tensor | None = None) -> None:
        """``dtype``: the hidden-state output's; ``logits``: the output is the LM head's float32 logits
        (``step.logits``), written into ``logits_out[:slots]`` when given (float32, at least ``slots``
        rows of ``step.vocab_size``, on the step's device), else into a buffer of the runner's own."""
        super().__init__(backend, ladder, True, metrics)
        if slots < 1:
            raise ValueError(f"prefill request slots must be >= 1, got {slots}")
        if max_padding_ratio < 1:
            raise ValueError(f"max_padding_ratio must be >= 1, got {max_padding_ratio}")
        self.step = step
        self.slots = slots
        self.max_padding_ratio = max_padding_ratio
        self.logits = logits
        if logits_out is not None:
            if not logits:
                raise ValueError("logits_out is the LM head's output: it needs logits=True")
            fits = (logits_out.dim() == 2 and logits_out.shape[0] >= slots and logits_out.shape[1] == step.vocab_size
                    and logits_out.dtype == torch.float32 and logits_out.device == step.device)
            if not fits:
                raise ValueError(f"logits_out {tuple(logits_out.shape)} {logits_out.dtype} on {logits_out.device} "
                                 f"cannot hold {slots} rows of {step.vocab_size} float32 logits on {step.device}")
            out = logits_out[:slots]
        elif logits:
            out = torch.zeros((slots, step.vocab_size), dtype=torch.float32, device=step.device)
        else:
            out = torch.zeros((slots, step.hidden_size), dtype=dtype, device=step.device)
        self.buffers = PrefillBuffers.allocate(self.ladder[-1], slots, out, step.device)

    def batch_size(self, batch: LivePrefillBatch) -> int:
        return batch.num_tokens

    def _choose(self, batch: LivePrefillBatch) -> BucketChoice:
        if batch.num_requests > self.slots or batch.num_rows > self.slots:
            return BucketChoice(None, "too_many_requests")
        choice = choose_bucket(batch.num_tokens, self.ladder, padding=True)
        if choice.replays and choice.size > self.max_padding_ratio * batch.num_tokens:
            return BucketChoice(None, "padding_waste")
        return choice

    def capture_callable(self, size: int) -> Callable[[], None]:
        ids, pos = self.buffers.tokens.views(size)
        rows, out = self.buffers.rows, self.buffers.out
        self.step.plan_dummy(size, self.slots)

        def forward() -> None:
            torch.index_select(self.step.forward_hidden(ids, pos), 0, rows, out=out)

        def forward_logits() -> None:
            out.copy_(self.step.logits(self.step.forward_hidden(ids, pos).index_select(0, rows)))

        return forward_logits if self.logits else forward

    def load(self, batch: LivePrefillBatch, size: int) -> None:
        self.buffers.tokens.load(batch.input_ids, batch.positions, size)
        k = batch.num_rows
        if k:
            self.buffers.rows[:k].copy_(batch.rows)
        self.buffers.rows[k:].zero_()  # token 0 always exists in a shape: a valid, unread row
        self.step.plan(batch.attention, size, self.slots)

    def outputs(self, batch: LivePrefillBatch) -> torch.Tensor:
        return self.buffers.out[: batch.num_rows]
