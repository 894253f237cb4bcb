"""Per-request sampling parameters (validated, immutable). Importing this module does not need torch."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

#: Temperatures below this are treated as greedy (as vLLM does), which also keeps ``logits / T`` finite.
GREEDY_EPS = 1e-5
#: Most alternatives a request may ask for per token (vLLM's default ``max_logprobs`` and OpenAI's
#: limit); the sampler always takes this many when any row asks, so its kernels keep one shape.
MAX_TOP_LOGPROBS = 20

_SEED_MIN = -(1 << 63)
_SEED_END = 1 << 64


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; the message names the field, the value and what is allowed."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingParamsError(f"{name} must be a number, got {type(v).__name__} {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise SamplingParamsError(f"{name} must be a finite number, got {v!r}")
    return f


def _integer(name: str, v: object) -> int:
    if not _is_int(v):
        raise SamplingParamsError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    return v  # type: ignore[return-value]


def _boolean(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise SamplingParamsError(f"{name} must be a bool, got {type(v).__name__} {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens (semantics follow vLLM / SGLang).

    Fields:
        max_tokens: maximum number of output tokens, >= 1.
        temperature: logits are divided by it, >= 0; below ``GREEDY_EPS`` (e.g. 0) means greedy
            (argmax of the raw logits; top_k / top_p / min_p / seed are then irrelevant).
        top_p: nucleus sampling, in (0, 1]: keep the smallest set of most likely tokens whose
            cumulative probability is >= top_p (always at least the top token); 1 disables it.
        top_k: keep the k most likely tokens; -1 or 0 disables it.
        min_p: drop tokens whose probability is < min_p * (probability of the top token), in [0, 1].
        seed: per-request seed in [-2**63, 2**64) (seeds equal modulo 2**64 are the same stream);
            None lets the engine draw one on the host (see :meth:`effective_seed`).
        stop: strings that end generation (a single string is accepted); each non-empty.
        stop_token_ids: token ids (>= 0) that end generation.
        ignore_eos: keep generating past the EOS token.
        logprobs: report the log-probability of each sampled token.
        top_logprobs: also report the log-probabilities of this many most likely tokens at each
            position, in [0, ``MAX_TOP_LOGPROBS``]; more than 0 needs ``logprobs``. A token's
            entry is then ``(logprob, ids, logprobs)`` (the alternatives, most likely first)
            instead of the bare log-probability.
        logit_bias: (token id, bias) pairs added to the logits before sampling, greedy included
            (OpenAI's ``logit_bias``: -100 bans a token, +100 all but forces it); a dict
            ``{token id: bias}`` is accepted. Ids >= 0, each once; biases finite, in [-100, 100].
            Log-probabilities stay those of the unbiased logits (vLLM's raw log-probabilities).
        n: number of output sequences for the prompt, >= 1.
        prompt_logprobs: None, or report the log-probability of every prompt token after the first
            (computed from the prefill, as vLLM's ``prompt_logprobs``) with this many most likely
            alternatives, in [0, ``MAX_TOP_LOGPROBS``]; entries as ``logprobs``' with alternatives.
        presence_penalty: subtracted from the logit of every token the output has so far, in [-2, 2].
        frequency_penalty: subtracted once per occurrence in the output so far, in [-2, 2].
        repetition_penalty: > 0, at most 100; the logit of a token in the prompt or the output so far
            is divided by it when positive and multiplied by it otherwise (1 disables it).
            The penalties follow vLLM: after ``logit_bias``, before temperature, greedy rows
            included; log-probabilities stay those of the raw logits.

    Invalid values raise :class:`SamplingParamsError`. ``stop`` / ``stop_token_ids`` given as lists
    are normalised to tuples and ints given for float fields to floats, so instances are hashable.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None
    #: derived: whether a presence, frequency or repetition penalty applies (read once per row and step)
    penalized: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if _integer("max_tokens", self.max_tokens) < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens!r}")

        t = _number("temperature", self.temperature)
        if t < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}")
        put("temperature", t)

        p = _number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        put("top_p", p)

        if _integer("top_k", self.top_k) < -1:
            raise SamplingParamsError(f"top_k must be >= -1 (-1 or 0 disables top-k), got {self.top_k!r}")

        m = _number("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}")
        put("min_p", m)

        if self.seed is not None:
            if not _is_int(self.seed):
                raise SamplingParamsError(
                    f"seed must be None or an int, got {type(self.seed).__name__} {self.seed!r}")
            if not _SEED_MIN <= self.seed < _SEED_END:
                raise SamplingParamsError(f"seed must be in [-2**63, 2**64), got {self.seed!r}")

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise SamplingParamsError(
                f"stop must be a string or a list of strings, got {type(stop).__name__} {stop!r}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(f"stop[{i}] must be a non-empty string, got {s!r}")
        put("stop", tuple(stop))

        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise SamplingParamsError(
                f"stop_token_ids must be a list of ints, got {type(ids).__name__} {ids!r}")
        for i, tok in enumerate(ids):
            if not _is_int(tok) or tok < 0:
                raise SamplingParamsError(f"stop_token_ids[{i}] must be an int >= 0, got {tok!r}")
        put("stop_token_ids", tuple(ids))

        _boolean("ignore_eos", self.ignore_eos)
        _boolean("logprobs", self.logprobs)
        if not 0 <= _integer("top_logprobs", self.top_logprobs) <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamsError("top_logprobs needs logprobs=True")

        if _integer("n", self.n) < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n!r}")

        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        if not isinstance(pairs, (list, tuple)):
            raise SamplingParamsError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
        seen, normalised = set(), []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise SamplingParamsError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
            tok, value = pair
            if not _is_int(tok) or tok < 0:
                raise SamplingParamsError(f"logit_bias token id must be an int >= 0, got {tok!r}")
            if tok in seen:
                raise SamplingParamsError(f"logit_bias has token id {tok} twice")
            seen.add(tok)
            v = _number(f"logit_bias[{tok}]", value)
            if not -100 <= v <= 100:
                raise SamplingParamsError(f"logit_bias[{tok}] must be in [-100, 100], got {value!r}")
            normalised.append((int(tok), v))
        put("logit_bias", tuple(sorted(normalised)))

        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            put(name, v)
        r = _number("repetition_penalty", self.repetition_penalty)
        if not 0 < r <= 100:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        put("repetition_penalty", r)
        put("penalized", self.presence_penalty != 0 or self.frequency_penalty != 0 or r != 1)
        if self.prompt_logprobs is not None and not 0 <= _integer("prompt_logprobs", self.prompt_logprobs) \
                <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], "
                                      f"got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature < ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    def effective_seed(self, rng: random.Random | None = None) -> int:
        """``seed`` if set, else a fresh 62-bit seed from ``rng`` (default: the ``random`` module).

        Call once per request on the host and keep the result: the sampler's draws depend only on
        (seed, step, token id), so reusing it is what makes a request reproducible.
        """
        if self.seed is not None:
            return self.seed
        return (rng or random).getrandbits(62)
