"""A generation request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from worker.page_table import PageTable
from worker.sampling.params import SamplingParams


class RequestRejected(ValueError):
    """A request refused at admission; the message names the problem. Nothing else is affected."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence. ``token_ids`` is prompt + output; ``num_computed`` tokens have KV in ``pages``.

    A request is *prefilling* until ``num_computed == len(token_ids)`` has been reached once and a
    token sampled; preemption drops its pages (its refs, with prefix caching) and sends it back to
    prefill over all its tokens but those it then finds cached.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: PageTable = field(default_factory=PageTable)
    num_computed: int = 0
    num_pending: int = 0  # tokens sampled by steps in flight, not yet read back (async scheduling)
    prefilling: bool = True
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's)
    num_preemptions: int = 0
    #: prompt tokens found in the prefix cache when it was first scheduled (vLLM's num_cached_tokens);
    #: None until then
    cached_tokens: int | None = None
    #: prompt tokens the fleet's router expected this engine to have cached when it placed the request;
    #: until the scheduler admits it, its group's load counts its prefill without them (cluster/engine_host.py)
    expected_cached_tokens: int = 0
    #: content keys of its first full pages, hashed once each (its tokens never change)
    page_keys: list[bytes] = field(default_factory=list, repr=False)
    #: leading pages of ``pages`` that are in the prefix cache or were offered to it (reset by preemption)
    num_cached_pages: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when a step first took it from the waiting queue
    first_token_time: float | None = None
    #: with ``params.prompt_logprobs``: an entry ``(logprob, ids, logprobs)`` per prompt token after
    #: the first, in order, as the prefill steps read them back
    prompt_logprobs: list[tuple[float, list[int], list[float]]] = field(default_factory=list)
    prompt_logprob_next: int = 0  # the next prompt position a prefill step is asked to score
    _distinct_prompt: np.ndarray | None = field(default=None, repr=False)
    _outputs: np.ndarray | None = field(default=None, repr=False)
    _outputs_len: int = field(default=0, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def distinct_prompt_ids(self) -> np.ndarray:
        """The prompt's distinct token ids, int64 (computed once: what a repetition penalty counts)."""
        if self._distinct_prompt is None:
            self._distinct_prompt = np.unique(np.asarray(self.prompt_ids, dtype=np.int64))
        return self._distinct_prompt

    def output_array(self) -> np.ndarray:
        """``output_ids`` as an int64 array view, kept in a buffer that grows with the outputs (a
        penalized request's step message carries them every step: a step costs O(new tokens))."""
        buf, have, n = self._outputs, self._outputs_len, len(self.output_ids)
        if buf is None or have > n or n > len(buf):
            buf, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
            self._outputs = buf
        if have < n:
            buf[have:n] = self.output_ids[have:n]
            self._outputs_len = n
        return buf[:n]

    def tokens(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` without building the whole sequence (a decode step asks for one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence once the steps in flight land: ``num_tokens + num_pending``."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    def ends_with_pending(self, max_model_len: int) -> bool:
        """Whether the tokens in flight already end it by length (no further step is worth sending)."""
        return self.num_pending > 0 and (len(self.output_ids) + self.num_pending >= self.params.max_tokens
                                         or self.seq_len >= max_model_len)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        """Extra pages this request needs to hold ``num_tokens`` tokens in total."""
        return max(0, -(-num_tokens // page_size) - len(self.pages))
