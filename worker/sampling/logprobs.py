"""Log-probabilities of sampled tokens and the most likely alternatives, on the device.

:func:`logprobs_of` is what the sampler returns for rows that ask (and what the prompt scorer
returns for prompt positions): on CUDA the fused kernels of :mod:`worker.sampling.fused_logprobs`,
elsewhere :func:`torch_logprobs_of`, whose top-k is :func:`top_k_rows`. All only enqueue device work.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

__all__ = ["TOP_K_CHUNK", "fused_tail", "logprobs_of", "probe_fused_tail", "top_k_rows", "torch_logprobs_of"]

log = logging.getLogger(__name__)


def logprobs_of(unbiased: torch.Tensor, tokens: torch.Tensor, width: int,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(float32 log-probabilities of ``tokens`` (B,) under logits ``unbiased`` (B, V) of any float
    dtype, and the ``width`` most likely tokens' ids and log-probabilities, None when ``width`` is 0).

    CUDA tensors (where Triton is present) take the fused kernels of
    :mod:`worker.sampling.fused_logprobs`, which read any float dtype and compute in float32; others
    :func:`torch_logprobs_of` of the logits upcast to float32 (a copy only when they are not)."""
    width = min(width, unbiased.shape[-1])
    fused = fused_tail(unbiased.device, unbiased.shape[-1], width, unbiased.dtype) if unbiased.is_cuda else None
    if fused is not None:
        return fused(unbiased, tokens, width)[:3]
    return torch_logprobs_of(unbiased.to(torch.float32), tokens, width)


@functools.cache
def _fused_kernels():
    try:
        from worker.sampling.fused_logprobs import logprob_tail
    except ImportError:
        return None
    return logprob_tail


#: (device, vocabulary, width, logits dtype) -> whether the fused kernels passed their probe there
_probed: dict[tuple, bool] = {}


def fused_tail(device: torch.device | str, vocab: int, width: int, dtype: torch.dtype = torch.float32):
    """:func:`worker.sampling.fused_logprobs.logprob_tail` where it works for logits of ``vocab``
    columns and ``dtype`` with ``width`` alternatives on ``device``, else None (Triton absent, or
    the kernels failed their probe: the torch path then serves).

    Every kernel constant derives from (vocabulary, width) and the logits' dtype, so each such
    variant is probed once, on its first ask (:func:`probe_fused_tail`, which compiles it): a
    model runner asks for the ones its decode steps use when it starts. An ask while the current
    stream captures, before that variant's probe, gets None without probing (a probe
    synchronises); the caller's capture then records the torch path."""
    kernel = _fused_kernels()
    if kernel is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, vocab, width, dtype)
    ok = _probed.get(key)
    if ok is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ok = _probed[key] = probe_fused_tail(kernel, device, vocab, width, dtype)
    return kernel if ok else None


def probe_fused_tail(kernel, device: torch.device | str, vocab: int = 1000, width: int = 5,
                     dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``kernel`` (a ``logprob_tail``) runs on ``device`` for three rows of ``vocab`` random
    logits of ``dtype`` with ``width`` alternatives, and equals :func:`torch_logprobs_of` of them
    upcast (chosen log-probabilities and top values within 1e-4, ids equal or holding the same
    values) with its packed rows equal to :func:`~worker.sampling.packed_rows.pack` of its outputs.
    Any failure (a Triton compile error on this GPU, too little shared memory for this variant, a
    launch error) is logged with its reason and answers False. Synchronises the device: call it
    outside captures (a model runner does at start)."""
    from worker.sampling.packed_rows import pack

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, vocab, generator=g) * 4).to(device=device, dtype=dtype)
    tokens = torch.tensor([0, vocab // 2, vocab - 1], device=device)
    try:
        out = kernel(logits, tokens, width)
        chosen, ids, values, packed = out
        ref_chosen, ref_ids, ref_values = torch_logprobs_of(logits.float(), tokens, width)
        same = torch.allclose(chosen, ref_chosen, atol=1e-4)
        if width:
            logp = logits.float().log_softmax(-1)
            same = same and torch.allclose(values, ref_values, atol=1e-4) and (
                torch.equal(ids, ref_ids) or torch.allclose(logp.gather(1, ids.long()), ref_values, atol=1e-4))
        same = same and packed is not None and torch.equal(packed, pack(tokens, chosen, ids, values))
    except Exception as e:  # noqa: BLE001 - whatever the kernels raise here, the torch path serves instead
        log.warning("fused log-probability kernels unusable on %s for %d columns of %s, width %d (the torch ops "
                    "serve instead): %s: %s", device, vocab, dtype, width, type(e).__name__, e)
        return False
    if not same:
        log.warning("fused log-probability kernels disagree with the torch ops on %s for %d columns of %s, "
                    "width %d (the torch ops serve instead)", device, vocab, dtype, width)
    return bool(same)


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
