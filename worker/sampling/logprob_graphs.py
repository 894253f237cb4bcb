"""The log-probability tail of a step as one CUDA graph per (bucket, width): one launch, not ~15.

The tail is two kernels on CUDA (:mod:`worker.sampling.fused_logprobs`, which packs the
read-back's rows as it goes) and about 15 torch ops elsewhere; launched one by one, on a host-bound
step (tinyllama at batch 64 on the H200, ~30 us of host per torch op) even a few launches cost
more than the device time they add (issue 19). :class:`LogprobGraphs` captures the tail, with the packing of
the read-back's rows (:func:`worker.sampling.packed_rows.pack`), over a static input, and serves a
call with one replay, a copy of the logits only when they are not already in the static input,
and a copy of the tokens unless the batch is greedy over the static input itself
(:meth:`LogprobGraphs.greedy`: its argmax goes straight into the static token rows).

Shapes. The sampler sees the live batch (the decode runner returns rows ``[0, n)`` of its static
output), any size from 1 to the static input's R rows. A call of n rows replays the graph of the
smallest bucket >= n of ``default_decode_ladder(R)``; rows ``[n, bucket)`` hold stale logits and
token ids whose results nobody reads (every op is row-wise; the token buffer starts at 0 and
only ever holds sampled ids, so its stale rows are valid gather indices). A call of more rows, of
another vocabulary, width or device, or made while the stream captures runs
:func:`~worker.sampling.logprobs.logprobs_of` eagerly. So at most ``len(ladder) * len(widths)``
graphs and ``R * len(widths)`` cached views exist: nothing grows without bound.

Invariants and hazards:

- Static input (owner: whoever passes ``logits``): its contents must be dead between steps and
  written and read only in stream order. The decode runner's static logits are: each decode
  replay rewrites them and only its own step reads them. A replayed decode step's logits *are*
  its rows ``[0, n)``, so nothing is copied; other logits (an eager or prefill step's) are copied
  in, on the current stream, after everything queued before them.
- Static outputs: a call returns views of its graph's outputs, which the next call of the same
  shape overwrites. No clone is needed because their one reader enqueues its read first:
  :meth:`worker.worker.Worker.launch` queues :meth:`worker.readback.TokenReadback.copy` (the
  device-to-host copy) right after ``ModelRunner.execute``, on the same stream, before it
  returns, so the next step's replay runs after that copy in stream order; a follower rank
  (``read_back=False``) never reads them. A caller keeping them across calls must clone them.
- Capture: lazy, on a shape's first call, into the process graph pool on the process capture
  stream (:mod:`graphs.process`), never inside another capture, in ``thread_local`` mode (other
  threads of the process, such as KV transfers, may use CUDA meanwhile; for the same reason
  :func:`graphs.capture_failures.sync_is_error`, process-wide, is not on). The first capture of a
  width captures the largest bucket first, so smaller ones reuse its scratch in the pool
  (graphs/DESIGN.md: largest first). A capture synchronises the device once. A failed capture
  is logged and that shape runs eagerly from then on.
- Teardown: :meth:`LogprobGraphs.release` resets the graphs before the buffers they read go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from graphs.buckets import choose_bucket, default_decode_ladder
from graphs.capture_failures import offending_call, root_cause
from graphs.process import capture_stream, graph_pool
from worker.sampling.logprobs import fused_tail, logprobs_of
from worker.sampling.packed_rows import pack
from worker.sampling.params import MAX_TOP_LOGPROBS

__all__ = ["LogprobGraphs", "capture_cuda_graph", "logprob_tail"]

log = logging.getLogger(__name__)

#: (log-probabilities (B,), top ids (B, W) or None, top log-probabilities or None, packed rows or None)
Tail = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
#: ``capture(fn, device)`` -> (an object with ``replay()`` and ``reset()``, ``fn``'s outputs, which
#: every replay rewrites in place)
Capture = Callable[[Callable[[], Tail], torch.device], tuple[Any, Tail]]
_UNSEEN = object()


def logprob_tail(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> Tail:
    """:func:`~worker.sampling.logprobs.logprobs_of` of float32 ``logits`` and its packed rows (on
    CUDA the fused kernels, which pack as they go)."""
    fused = fused_tail(logits.device, logits.shape[-1], width, logits.dtype) if logits.is_cuda else None
    if fused is not None:
        return fused(logits, tokens, width)
    chosen, ids, values = logprobs_of(logits, tokens, width)
    return chosen, ids, values, pack(tokens, chosen, ids, values)


def capture_cuda_graph(fn: Callable[[], Tail], device: torch.device) -> tuple[torch.cuda.CUDAGraph, Tail]:
    """Record ``fn`` into a CUDA graph (its outputs allocated in the process pool) after one eager
    warm-up on the capture stream; see the module docstring for the mode and the pool."""
    stream = capture_stream(device)
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            fn()  # outside the pool: what a first run creates lazily exists before capture
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=graph_pool(device), stream=stream, capture_error_mode="thread_local"):
                outputs = fn()
        except BaseException:
            graph.reset()
            raise
    return graph, outputs


@dataclass(frozen=True)
class _Served:
    """What a call of one (rows, vocabulary, width, device) touches: views of the static buffers."""

    logits: torch.Tensor  # rows [0, n) of the static input
    tokens: torch.Tensor  # rows [0, n) of the static token ids
    graph: Any
    outputs: Tail  # rows [0, n) of the graph's outputs


class LogprobGraphs:
    """The log-probability tail replayed from captured graphs over the static input ``logits``
    ((R, V) float32, see the module docstring); ``widths``: the top-k widths served from graphs.

    ``capture`` records a shape (default: :func:`capture_cuda_graph` on a CUDA device; on any
    other device every call runs eagerly unless one is given, as the CPU tests do).
    """

    def __init__(self, logits: torch.Tensor, widths: Iterable[int] = (0, MAX_TOP_LOGPROBS),
                 capture: Capture | None = None) -> None:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"the static input must be (rows, vocab) float32, got {tuple(logits.shape)} "
                             f"{logits.dtype}")
        self.device = logits.device
        self.widths = frozenset(widths)
        self.ladder = default_decode_ladder(logits.shape[0])
        self.replays = 0
        self._logits = logits
        self._ptr, self._stride = logits.data_ptr(), logits.stride()
        self._tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        self._capture = capture if capture is not None else capture_cuda_graph if logits.is_cuda else None
        if self._capture is capture_cuda_graph:
            graph_pool(self.device)  # created now, not mid-step: its anchor graph captures in global mode
        self._graphs: dict[tuple[int, int], tuple[Any, Tail] | None] = {}  # (bucket, width) -> graph, outputs
        self._served: dict[tuple, _Served | None] = {}  # (rows, vocab, width, device) -> views; None: eager

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (bucket, width) shapes captured so far."""
        return sorted(k for k, g in self._graphs.items() if g is not None)

    def __call__(self, unbiased: torch.Tensor, tokens: torch.Tensor, width: int) -> Tail:
        """``logprob_tail`` of ``unbiased`` (B, V) logits of any float dtype (upcast to float32 as they
        are copied in, or by ``logprobs_of``) at ``tokens`` (B,): replayed, or eager (packed rows None).

        Only enqueues device work. Replayed outputs are views of static buffers that the next call
        of the shape overwrites (see the module docstring)."""
        served = self._lookup(unbiased, width)
        if served is None:
            return _eager(unbiased, tokens, width)
        if not self._is_static_rows(unbiased):
            served.logits.copy_(unbiased)
        served.tokens.copy_(tokens)
        return self._replay(served)

    def greedy(self, unbiased: torch.Tensor, width: int) -> tuple[torch.Tensor, Tail] | None:
        """For logits that are the static input's own rows ``[0, n)``: their argmax written straight
        into the static token rows the replay reads, then the replay; (those token rows, the tail).
        None when such logits would not replay (the caller samples and calls the graphs as usual).

        The tokens are a view of a static buffer, as the outputs are: the next call of the shape
        overwrites them, after the step's read-back copy in stream order (the module docstring)."""
        served = self._static_served(unbiased, width)
        if served is None:
            return None
        torch.argmax(unbiased, dim=-1, out=served.tokens)  # upcasting is exact: any dtype's argmax
        return served.tokens, self._replay(served)

    def token_rows(self, unbiased: torch.Tensor, width: int) -> torch.Tensor | None:
        """The static token rows :meth:`greedy` writes for ``unbiased``, or None when it would not."""
        served = self._static_served(unbiased, width)
        return None if served is None else served.tokens

    def _static_served(self, unbiased: torch.Tensor, width: int) -> _Served | None:
        """:meth:`_lookup` for logits that are the static input's own rows, else None."""
        return self._lookup(unbiased, width) if self._is_static_rows(unbiased) else None

    def _is_static_rows(self, unbiased: torch.Tensor) -> bool:
        """Whether ``unbiased`` is the static input's own rows ``[0, n)`` (nothing to copy in)."""
        return (unbiased.data_ptr() == self._ptr and unbiased.dtype == torch.float32
                and unbiased.stride() == self._stride)

    def _lookup(self, unbiased: torch.Tensor, width: int) -> _Served | None:
        """The views a call of ``unbiased`` and ``width`` replays with, or None: eager (inside another
        capture: neither capture nor replay there)."""
        if unbiased.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        key = (*unbiased.shape, width, unbiased.device)
        served = self._served.get(key, _UNSEEN)
        if served is _UNSEEN:
            served = self._serve(key)
        return served

    def _replay(self, served: _Served) -> Tail:
        served.graph.replay()
        self.replays += 1
        return served.outputs

    def release(self) -> None:
        """Reset every captured graph and forget every shape (later calls capture again)."""
        for captured in self._graphs.values():
            if captured is not None:
                captured[0].reset()
        self._graphs.clear()
        self._served.clear()

    def _serve(self, key: tuple) -> _Served | None:
        """The views a call of ``key`` uses (capturing its bucket first), or None: eager."""
        if len(key) != 4:
            return None
        rows, vocab, width, device = key
        if (self._capture is None or device != self.device or vocab != self._logits.shape[1]
                or width not in self.widths or not 1 <= rows <= self.ladder[-1]):
            return None  # not remembered: only keys that could replay are, so the cache stays bounded
        served = None
        captured = self._graph(choose_bucket(rows, self.ladder, padding=True).size, width)
        if captured is not None:
            graph, outputs = captured
            served = _Served(self._logits[:rows], self._tokens[:rows], graph,
                             tuple(None if t is None else t[:rows] for t in outputs))
        self._served[key] = served  # None too: a shape whose capture failed stays eager
        return served

    def _graph(self, bucket: int, width: int) -> tuple[Any, Tail] | None:
        """The graph of ``bucket`` rows and ``width``, captured now if it was not (largest first)."""
        for size in dict.fromkeys((self.ladder[-1], bucket)):
            if (size, width) not in self._graphs:
                self._graphs[(size, width)] = self._capture_shape(size, width)
        return self._graphs[(bucket, width)]

    def _capture_shape(self, bucket: int, width: int) -> tuple[Any, Tail] | None:
        logits, tokens = self._logits[:bucket], self._tokens[:bucket]
        try:
            return self._capture(lambda: logprob_tail(logits, tokens, width), self.device)
        except Exception as e:  # noqa: BLE001 - any failure leaves the shape eager, reported with its call
            root = root_cause(e)
            log.warning("log-probability graph of %d rows, width %d, not captured (runs eagerly): %s at %s: %s",
                        bucket, width, type(root).__name__, offending_call(root), root)
            return None


def _eager(unbiased: torch.Tensor, tokens: torch.Tensor, width: int) -> Tail:
    return (*logprobs_of(unbiased, tokens, width), None)
