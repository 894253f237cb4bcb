"""Log-probabilities of sampled tokens and the most likely alternatives, on the device.

:func:`logprobs_of` is what the sampler returns for rows that ask (and what the prompt scorer
returns for prompt positions): on CUDA the fused kernels of :mod:`worker.sampling.fused_logprobs`,
elsewhere :func:`torch_logprobs_of`, whose top-k is :func:`top_k_rows`. All only enqueue device work.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["TOP_K_CHUNK", "fused_tail", "logprobs_of", "top_k_rows", "torch_logprobs_of"]


def logprobs_of(unbiased: torch.Tensor, tokens: torch.Tensor, width: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(float32 log-probabilities of ``tokens`` (B,) under logits ``unbiased`` (B, V) of any float
    dtype, and the ``width`` most likely tokens' ids and log-probabilities, None when ``width`` is 0).

    CUDA tensors (where Triton is present) take the fused kernels of
    :mod:`worker.sampling.fused_logprobs`, which read any float dtype and compute in float32; others
    :func:`torch_logprobs_of` of the logits upcast to float32 (a copy only when they are not)."""
    fused = fused_tail() if unbiased.is_cuda else None
    if fused is not None:
        return fused(unbiased, tokens, min(width, unbiased.shape[-1]))[:3]
    return torch_logprobs_of(unbiased.to(torch.float32), tokens, width)


@functools.cache
def fused_tail():
    """:func:`worker.sampling.fused_logprobs.logprob_tail`, or None where Triton is absent."""
    try:
        from worker.sampling.fused_logprobs import logprob_tail
    except ImportError:
        return None
    return logprob_tail


def torch_logprobs_of(unbiased: torch.Tensor, tokens: torch.Tensor, width: int,
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`logprobs_of` in torch ops (any device; the fused kernels' reference).

    One fused ``log_softmax`` (a single kernel; ``logsumexp`` is a chain of seven over the whole
    row), then a gather and :func:`top_k_rows` on its output: the top values are log-probabilities
    already."""
    logp = unbiased.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if not width:
        return chosen, None, None
    values, ids = top_k_rows(logp, min(width, logp.shape[-1]))
    return chosen, ids, values


#: :func:`top_k_rows`' chunk width: a row is cut into chunks of this many entries.
TOP_K_CHUNK = 128


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1, sorted=True)`` of a (B, V) tensor, reading the full rows once.

    Each row is cut into chunks of :data:`TOP_K_CHUNK` and the chunks with the k largest maxima
    are searched: every entry of the row's top k lies in one of them (an entry ranked i has at most
    i - 1 larger entries, so at most i chunks have a larger maximum than its chunk's, and ties are
    made up by chunks whose maximum equals the k-th value). The values equal ``topk``'s; among
    equal values the ids may be other equal-valued ids (``topk`` does not promise an order among
    ties either). A full-width radix select over a 32k vocabulary was four passes of four kernels
    each on the H200 (bench/results/step_profile-20261204T145916.json); this is one ``amax`` over
    the rows and small top-ks of k chunks' entries.
    """
    b, v = x.shape
    n = v // TOP_K_CHUNK
    if n < 4 * k:  # a small vocabulary: the plain top-k is as cheap
        return x.topk(k, dim=-1, sorted=True)
    if n * TOP_K_CHUNK != v:  # the last, partial chunk is padded with -inf (a copy: odd vocabularies only)
        n += 1
        x = torch.nn.functional.pad(x, (0, n * TOP_K_CHUNK - v), value=-math.inf)
    maxima = x.view(b, n, TOP_K_CHUNK).amax(dim=-1)
    chunks = maxima.topk(k, dim=-1, sorted=False).indices
    columns = (chunks[:, :, None] * TOP_K_CHUNK
               + torch.arange(TOP_K_CHUNK, device=x.device)).view(b, k * TOP_K_CHUNK)
    values, at = x.gather(1, columns).topk(k, dim=-1, sorted=True)
    return values, columns.gather(1, at)
