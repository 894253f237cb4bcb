"""Batched token sampler that never synchronises with the host.

``sample(logits, batch)`` only enqueues device work: no ``.item()`` / ``.tolist()`` / ``.cpu()``, no
data-dependent shapes (boolean-mask indexing, ``nonzero``), no ``torch.multinomial``. Every branch
is decided by host-side flags computed in :meth:`SamplingBatch.build`, so the engine can call it right
after the forward pass and read the tokens later (reading them is the caller's one sync).

Semantics (vLLM / SGLang): scale by temperature, then top-k, then top-p over the renormalised
top-k set (keep the smallest prefix of the sorted tokens whose cumulative probability is >= top_p,
always at least the top token), then min-p (drop tokens with prob < min_p * max_prob), then draw.
Greedy rows (temperature < ``GREEDY_EPS``) take the argmax of the raw logits, first index on ties.
top-k and top-p keep a prefix of the descending sort, so ties exactly at the cut are broken by sort
order (lower token id first for the full stable sort; whatever ``torch.topk`` returns otherwise).

Randomness: the draw is the Gumbel-max trick, ``argmax(logits / T - log(E))`` with ``E ~ Exp(1)``
per (row, token), i.e. an exponential race; it samples from the filtered ``softmax(logits / T)``
(up to the 32-bit resolution of the noise). ``E`` comes from a counter-based hash of
(seed, step, token id) computed with int64 torch ops on the device, so a request's draw never
depends on the batch it is in, its row, the vocabulary padding or the device RNG state. ``step`` is
the index of the output token being generated (0 for the first). Requests without a seed must get
one drawn on the host by the caller (:meth:`SamplingParams.effective_seed`) and keep it for their
whole life. Caveat: top-p uses float softmax/cumsum whose rounding may depend on the sort width or
GPU kernel chosen for the batch, so a token whose cumulative probability is within float32 rounding
of top_p could in principle flip.

Logit bias (OpenAI's ``logit_bias``) is added to the rows' logits before anything else, greedy
rows included, as one ``index_put_`` of the batch's (row, token, bias) triples; a batch without
bias runs no extra kernel. Presence, frequency and repetition penalties come next
(:mod:`worker.sampling.penalties`); a batch without them runs nothing for them either.

Logprobs are "raw" logprobs, as vLLM reports by default: ``log_softmax`` of the unscaled,
unfiltered, unbiased logits at the chosen token (not of the distribution actually sampled from).
When any row asks for alternatives (``top_logprobs``), every row gets the ``MAX_TOP_LOGPROBS``
most likely tokens of the same distribution (one ``topk`` of one width whatever the rows asked,
so the step's kernels keep their shapes); each request reads the first ones it asked for.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from worker.host_staging import PinnedStaging
from worker.sampling.logprob_graphs import LogprobGraphs
from worker.sampling.logprobs import logprobs_of
from worker.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from worker.sampling.penalties import Penalties, PenaltyHistory, apply_penalties_

__all__ = ["SampleOutput", "SamplingBatch", "sample"]

_M32 = 0xFFFFFFFF
_TOP_K_OFF = 1 << 62  # "disabled" when the vocabulary size is not known at build time
# Above this largest top_k, a full sort is used instead of torch.topk.
_PARTIAL_SORT_MAX_K = 2048
_SEED_SALT = 0x5EED5A17
_TOKEN_SALT = 0x70C3A11D


class SampleOutput(NamedTuple):
    """Device tensors: ``token_ids`` (B,) int64; ``logprobs`` (B,) float32, None unless requested;
    ``top_ids`` (B, ``MAX_TOP_LOGPROBS``) int64 and ``top_logprobs`` (same shape, float32) the most
    likely tokens, most likely first, None unless some row asked for alternatives. ``prompt``: a
    prefill step's prompt log-probabilities (:meth:`worker.model_runner.ModelRunner.execute`),
    (logprobs (N,), top ids (N, W), top logprobs (N, W)) with W 0 when no request asked for
    alternatives; None when no request asked for them. ``packed``: when the log-probabilities
    were replayed from a graph, the tokens, log-probabilities and alternatives again as int32
    rows (:mod:`worker.sampling.packed_rows`), for a one-copy read-back; else None. With
    ``packed`` set, the tensors (``token_ids`` too, for a greedy batch over the static logits) are
    views of the log-probability graphs' static buffers, rewritten by their next replay."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    packed: torch.Tensor | None = None


def _row_values(p: SamplingParams, k_off: int) -> tuple:
    """(greedy, temperature, top_k, top_p, min_p, the row's enabled top-k or 0, logprobs, top
    logprobs) of one row, as :meth:`SamplingBatch.build` lays them out: a greedy row holds the
    neutral values."""
    if p.greedy:
        return 1, 1.0, k_off, math.inf, 0.0, 0, p.logprobs, p.top_logprobs
    k = p.top_k if 0 < p.top_k < k_off else 0
    return 0, p.temperature, k or k_off, p.top_p if p.top_p < 1.0 else math.inf, p.min_p, k, p.logprobs, p.top_logprobs


@dataclass(frozen=True)
class _HostRows:
    """What a batch's params decide, once per batch composition (see :class:`SamplingRows`)."""

    top_ks: np.ndarray  # (B,) int64
    greedy: np.ndarray  # (B,) int64, 1 for greedy rows
    floats: np.ndarray  # (3B,) int32: float32 bits of temperature, top_p, min_p
    flags: tuple  # SamplingBatch's host flags, in its field order (all_greedy .. want_top_logprobs)
    bias: np.ndarray | None = None  # (3, N) int64: row, token id, float32 bits of the bias; None: no bias
    #: (3B,) int64: float32 bits of presence, frequency and repetition penalty; None: no row penalized
    penalty_floats: np.ndarray | None = None
    repetition_any: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams], k_off: int) -> _HostRows:
        n = len(params)
        greedy, temps, top_ks, top_ps, min_ps, ks, logprobs, tops = (
            zip(*[_row_values(p, k_off) for p in params]) if n else ((),) * 8)
        enabled_k = [k for k in ks if k]
        needs_top_p = any(p < 1.0 for p in top_ps)
        needs_sort = bool(enabled_k) or needs_top_p
        topk_width = None
        if needs_sort and all(g or k for g, k in zip(greedy, ks)) and max(enabled_k) <= _PARTIAL_SORT_MAX_K:
            topk_width = max(enabled_k)
        triples = [(i, tok, b) for i, p in enumerate(params) for tok, b in p.logit_bias]
        bias = None
        if triples:
            rows_, toks, values = zip(*triples)
            bias = np.stack([np.array(rows_, dtype=np.int64), np.array(toks, dtype=np.int64),
                             np.array(values, dtype=np.float32).view(np.int32).astype(np.int64)])
        penalty_floats = None
        if any(p.penalized for p in params):
            penalty_floats = np.array([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                       [p.repetition_penalty for p in params]],
                                      dtype=np.float32).reshape(-1).view(np.int32).astype(np.int64)
        return cls(np.array(top_ks, dtype=np.int64), np.array(greedy, dtype=np.int64),
                   # float32 bit patterns ride along as int64 (sign-extended int32) so one copy carries all.
                   np.array([temps, top_ps, min_ps], dtype=np.float32).reshape(-1).view(np.int32),
                   (all(greedy), any(greedy), needs_sort, needs_top_p, any(m > 0 for m in min_ps), topk_width,
                    any(logprobs), any(tops)), bias, penalty_floats,
                   any(p.repetition_penalty != 1 for p in params))


class SamplingRows:
    """The host side of the last batch's sampling parameters, reused while the batch is the same
    params objects in the same order (a decode batch is, from one step to the next, until a
    request joins or leaves); it holds those objects, so an identity match is never a reused id."""

    def __init__(self) -> None:
        self._params: tuple[SamplingParams, ...] = ()
        self._k_off = -1
        self._rows: _HostRows | None = None

    def get(self, params: Sequence[SamplingParams], k_off: int) -> _HostRows:
        if (self._rows is None or k_off != self._k_off or len(params) != len(self._params)
                or not all(map(operator.is_, params, self._params))):
            self._params, self._k_off, self._rows = tuple(params), k_off, _HostRows.of(params, k_off)
        return self._rows


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors (row i = i-th request) plus host-side flags.

    Tensors (all shape (B,), on the sampling device; None when every row is greedy, since
    ``sample`` then takes the argmax and reads none of them, so such a batch costs no copy):
        temperature: float32; greedy rows hold 1.0 (their result is the raw argmax anyway).
        top_k: int64; disabled is the vocabulary size (or 2**62 if it was not given to ``build``).
        top_p: float32; disabled (1.0) is encoded as +inf so rounding can never drop a token.
        min_p: float32; 0 means disabled.
        seeds: int64, the effective seed wrapped to two's complement (seeds equal mod 2**64 agree).
        steps: int64, index of the output token being generated (0 for the first).
        greedy_mask: bool.
    ``bias``: None, or (row, token id, bias) of every logit bias entry of the batch: int64, int64,
    float32 tensors of shape (N,) (present whether or not the rows are greedy).
    ``penalties``: None, or the batch's :class:`worker.sampling.penalties.Penalties` (present whether
    or not the rows are greedy).
    Host flags (decide which kernels run; never read from device data):
        all_greedy / any_greedy, needs_sort (some non-greedy row uses top-k or top-p),
        needs_top_p, needs_min_p, topk_width (if not None, every non-greedy row has
        top_k <= topk_width and a partial ``torch.topk`` replaces the full sort), want_logprobs,
        want_top_logprobs (some row asked for alternatives: every row gets ``MAX_TOP_LOGPROBS``).
    """

    num_rows: int
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: torch.Tensor | None
    steps: torch.Tensor | None
    greedy_mask: torch.Tensor | None
    all_greedy: bool
    any_greedy: bool
    needs_sort: bool
    needs_top_p: bool
    needs_min_p: bool
    topk_width: int | None
    want_logprobs: bool
    want_top_logprobs: bool = False
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None

    @property
    def size(self) -> int:
        """Number of rows B."""
        return self.num_rows

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
              device: torch.device | str, *, vocab_size: int | None = None,
              staging: PinnedStaging | None = None, rows: SamplingRows | None = None,
              history: PenaltyHistory | None = None, input_ids: torch.Tensor | None = None) -> SamplingBatch:
        """Pack one row per request and copy it to ``device`` in a single (pinned, async) H2D copy
        (through ``staging``, the caller's ring of pinned buffers, when given). ``rows`` keeps each
        params object's row values from one step to the next (a request keeps its params).

        ``seeds[i]`` is request i's effective seed (its ``params.seed`` if set, otherwise one the
        caller drew once on the host); ``steps[i]`` is the number of output tokens it already has.
        ``vocab_size``, if given, lets top_k >= vocab_size count as disabled (skipping the sort).
        ``history`` holds what penalized rows count (none: nothing counted yet) and ``input_ids``
        the step's input ids on the device, where its in-flight tokens are.
        """
        n = len(params)
        if len(seeds) != n or len(steps) != n:
            raise ValueError(f"need one seed and one step per request: got {n} params, "
                             f"{len(seeds)} seeds, {len(steps)} steps")
        k_off = _TOP_K_OFF if vocab_size is None else int(vocab_size)
        if not set(map(type, steps)) <= {int} or (n and not 0 <= min(steps) <= max(steps) < 1 << 63):
            bad = next(s for s in steps if type(s) is not int or not 0 <= s < 1 << 63)  # a bool is not a step
            raise ValueError(f"step must be an int in [0, 2**63), got {bad!r}")
        if not set(map(type, seeds)) <= {int}:
            raise ValueError(f"seed must be an int, got {next(s for s in seeds if type(s) is not int)!r}")
        wrapped = seeds  # two's complement of the seed mod 2**64, as int64
        if n and not -(1 << 63) <= min(seeds) <= max(seeds) < 1 << 63:
            wrapped = [(seed + (1 << 63)) % (1 << 64) - (1 << 63) for seed in seeds]
        host = rows.get(params, k_off) if rows is not None else _HostRows.of(params, k_off)
        extra = [] if host.bias is None else [host.bias.reshape(-1)]
        if host.penalty_floats is not None:
            history = history or PenaltyHistory.of(None, [], [])
            if history.inflight_positions.size and input_ids is None:
                raise ValueError("a penalized row has a token in flight: pass the step's input_ids")
            extra += [host.penalty_floats, *history.parts()]
        if host.flags[0] and not extra:  # all greedy: the argmax needs no per-row tensor
            return cls(n, None, None, None, None, None, None, None, *host.flags)
        if staging is None:
            staging = PinnedStaging(device, capacity=7 * n + sum(a.size for a in extra), slots=2)
        if host.flags[0]:  # all greedy, with a bias or penalties: only those are staged
            rest = staging.stage(extra)
            return cls(n, None, None, None, None, None, None, None, *host.flags, **_extras(host, rest, n, input_ids))

        packed = np.empty(7 * n, dtype=np.int64)
        packed[:n], packed[n:2 * n], packed[2 * n:3 * n] = host.top_ks, wrapped, steps
        packed[3 * n:4 * n], packed[4 * n:] = host.greedy, host.floats
        dev, *rest = staging.stage([packed, *extra])
        dev = dev.view(7, n)
        f = dev[4:].to(torch.int32).view(torch.float32)
        return cls(n, f[0], dev[0], f[1], f[2], dev[1], dev[2], dev[3].bool(), *host.flags,
                   **_extras(host, rest, n, input_ids))


def _extras(host: _HostRows, staged: list[torch.Tensor], n: int, input_ids: torch.Tensor | None) -> dict:
    """``bias`` and ``penalties`` of a batch from their staged device views (in build's order)."""
    out: dict = {}
    if host.bias is not None:
        b = staged.pop(0).view(3, -1)
        out["bias"] = (b[0], b[1], b[2].to(torch.int32).view(torch.float32))
    if host.penalty_floats is not None:
        floats, out_rows, out_tokens, prompt_rows, prompt_tokens, inflight_rows, inflight_positions = staged
        f = floats.view(3, n).to(torch.int32).view(torch.float32)
        inflight = (input_ids.index_select(0, inflight_positions) if inflight_positions.numel()
                    else inflight_positions)
        out["penalties"] = Penalties(f[0], f[1], f[2], out_rows, out_tokens, prompt_rows, prompt_tokens,
                                     inflight_rows, inflight, host.repetition_any)
    return out


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    # x in [0, 2**32): using c - 2**32 for c >= 2**31 keeps |x * c| < 2**63 (no int64 overflow)
    # and is congruent mod 2**32; & with the mask takes the low 32 bits of the two's complement.
    return x.mul_(c - (1 << 32) if c >= 1 << 31 else c).bitwise_and_(_M32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place: a bijective 32-bit integer finaliser (Wellons' lowbias32) on int64 holding [0, 2**32)."""
    # Values stay non-negative, so >> (arithmetic in torch) acts as a logical shift.
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    x.bitwise_xor_(x >> 16)
    return x


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B,) 32-bit keys mixing all 64 bits of seed and of step."""
    k = _mix32_((seeds & _M32) ^ _SEED_SALT)
    k = _mix32_(k.bitwise_xor_((seeds >> 32) & _M32))
    k = _mix32_(k.bitwise_xor_(steps & _M32))
    return _mix32_(k.bitwise_xor_((steps >> 32) & _M32))


def _log_exponential(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 ``log(E)``, ``E ~ Exp(1)``, a pure function of (key of the row, token id).

    ``token_ids`` is (1, V) or (B, W) int64; the result broadcasts to (B, V) or (B, W).
    """
    t = _mix32_((token_ids + _TOKEN_SALT) & _M32)
    x = _mix32_(t ^ keys[:, None])
    # u in (0, 1): exact near 0 (the small-E tail that lets unlikely tokens win), clamped below 1.
    u = x.to(torch.float32).add_(0.5).mul_(2.0 ** -32).clamp_(max=1.0 - 2.0 ** -24)
    return u.neg_().log1p_().neg_().log_()


def _min_p_(x: torch.Tensor, x_max: torch.Tensor, min_p: torch.Tensor) -> None:
    # p_i / p_max == exp(x_i - x_max) for any renormalisation that keeps the top token.
    x.masked_fill_((x - x_max).exp_() < min_p[:, None], -math.inf)


def _filtered_sorted(s: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits sorted descending (full sort or top-``topk_width``) with filtered entries at -inf."""
    if b.topk_width is not None and b.topk_width < s.shape[-1]:
        vals, idx = s.topk(b.topk_width, dim=-1, sorted=True)
    else:
        vals, idx = s.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vals.shape[-1], device=s.device)
    vals.masked_fill_(ranks >= b.top_k[:, None], -math.inf)
    if b.needs_top_p:
        probs = vals.softmax(dim=-1)
        before = probs.cumsum(dim=-1).sub_(probs)
        drop = before >= b.top_p[:, None]
        drop[:, 0] = False  # the top token survives even a top_p that rounds to 0 in float32
        vals.masked_fill_(drop, -math.inf)
    if b.needs_min_p:
        _min_p_(vals, vals[:, :1], b.min_p)
    return vals, idx


def sample(logits: torch.Tensor, batch: SamplingBatch, *, logprob_graphs: LogprobGraphs | None = None,
           ) -> SampleOutput:
    """Sample one token per row of ``logits`` (B, V), any float dtype (computed in float32).

    Enqueues device work only (no host sync). Row i's token depends only on ``logits[i]`` and
    row i's parameters, seed and step. ``logits`` is not modified. With ``logprob_graphs`` the
    log-probabilities come from its graphs where it has one for the batch (then they are views
    of static outputs that its next call overwrites, and ``packed`` is set); without, eagerly.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.size:
        raise ValueError(f"logits must be (B={batch.size}, V), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor, got {logits.dtype}")
    # ``raw`` may alias ``logits`` (float32 input): never modify it in place (bias and penalties
    # work on a copy).
    processed = batch.bias is not None or batch.penalties is not None
    if processed:
        raw = logits.to(torch.float32, copy=True)
        if batch.bias is not None:
            rows, tokens, values = batch.bias
            raw.index_put_((rows, tokens), values, accumulate=True)
        if batch.penalties is not None:
            apply_penalties_(raw, batch.penalties)
    else:
        raw = logits if batch.all_greedy and not batch.want_logprobs else logits.to(torch.float32)
    width = MAX_TOP_LOGPROBS if batch.want_top_logprobs else 0
    if batch.all_greedy and batch.want_logprobs and logprob_graphs is not None and not processed:
        # over the graphs' static input: the argmax goes straight into their token rows, one replay
        replayed = logprob_graphs.greedy(raw, width)
        if replayed is not None:
            tokens, (chosen, ids, values, packed) = replayed
            return SampleOutput(tokens, chosen, ids, values, packed=packed)
    if batch.all_greedy:
        tokens = raw.argmax(dim=-1)  # upcasting is exact, so any float dtype gives the same argmax
    else:
        keys = _row_keys(batch.seeds, batch.steps)
        s = raw / batch.temperature[:, None]
        if batch.needs_sort:
            vals, idx = _filtered_sorted(s, batch)
            vals.sub_(_log_exponential(keys, idx))
            tokens = idx.gather(1, vals.argmax(dim=-1, keepdim=True)).squeeze(1)
        else:
            if batch.needs_min_p:
                _min_p_(s, s.amax(dim=-1, keepdim=True), batch.min_p)
            token_ids = torch.arange(s.shape[-1], device=s.device)[None, :]
            s.sub_(_log_exponential(keys, token_ids))
            tokens = s.argmax(dim=-1)
        if batch.any_greedy:
            tokens = torch.where(batch.greedy_mask, raw.argmax(dim=-1), tokens)
    if not batch.want_logprobs:
        return SampleOutput(tokens, None)
    unbiased = logits if processed else raw  # never the biased or penalized copy
    if logprob_graphs is None:
        return SampleOutput(tokens, *logprobs_of(unbiased, tokens, width))
    chosen, ids, values, packed = logprob_graphs(unbiased, tokens, width)  # it upcasts as it copies
    return SampleOutput(tokens, chosen, ids, values, packed=packed)
