"""The step message: one scheduled batch as plain host data, sent to every rank.

A message is a few lists of ints (token ids, positions), the page tables (one int32 array in CSR
form, :class:`~worker.page_table.PageRows`) and the sampling parameters of the sampled rows: small
enough to pickle once per step and hand to every tensor-parallel rank, and independent of the
scheduler's objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter

import numpy as np

from worker.attention.base import AttentionBatch
from worker.page_table import PageRows
from worker.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from worker.scheduler import ScheduledBatch


@dataclass
class StepMessage:
    """One prefill, decode or mixed step: tokens laid out request after request.

    A mixed step (``mixed``) is a prefill step whose first rows are decode rows: one-token requests
    that sample, followed by prefill chunks; the ranks run it through the prefill runner and count
    its pass as ``mixed``.
    """

    is_prefill: bool
    input_ids: list[int]
    positions: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    page_tables: PageRows
    logits_rows: list[int]
    params: list[SamplingParams]
    seeds: list[int]
    steps: list[int]
    return_logits: bool = False
    # (index into input_ids, row of the previous step's sampled tokens): input tokens the engine
    # has not read back yet (async scheduling); every rank takes them from its own last step.
    from_previous: list[tuple[int, int]] = field(default_factory=list)
    # What the penalties of penalized sampled rows count (worker.sampling.penalties), None when no
    # row is penalized: (the penalized sampled rows, then (sampled row, token id) columns of every
    # output token read back so far and, for a repetition penalty, of each distinct prompt token).
    # A token in flight is the row's input of this step and is taken on the device.
    penalties: tuple | None = None  # (rows, then int64 arrays: output rows, tokens, prompt rows, tokens)
    # Prompt log-probabilities this prefill step computes, None when no request asks: (the
    # alternatives' width, 0 or MAX_TOP_LOGPROBS; indices of input_ids whose next prompt token is
    # scored; those tokens).
    prompt_logprobs: tuple[int, list[int], list[int]] | None = None
    # The engine's own record of whose prompt positions those are, never sent to the ranks:
    # (request, first prompt position scored, how many), in the order of ``prompt_logprobs``.
    scored_prompts: list = field(default_factory=list)
    mixed: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    def __reduce__(self):
        # Wire form: each distinct SamplingParams object once, as a tuple of its field values, plus
        # an index per sampled row. Ray pickles with cloudpickle, whose Python-level hook runs once
        # per non-builtin object; tuples and lists of ints and floats pickle in C.
        slots: dict[int, int] = {}
        index = [slots.setdefault(id(p), len(slots)) for p in self.params]
        unique = {id(p): p for p in self.params}
        return (_unpack_step_message, (self.is_prefill, self.input_ids, self.positions, self.seq_lens, self.query_lens,
                                       self.page_tables, self.logits_rows,
                                       [_param_values(p) for p in unique.values()], index, self.seeds, self.steps,
                                       self.return_logits, self.from_previous, self.penalties,
                                       self.prompt_logprobs, self.mixed))

    def attention_batch(self) -> AttentionBatch:
        """The step's attention batch over this message's own lists (not copied).

        A rank does not change a message's lengths or page tables after receiving it (it fills
        only ``from_previous`` entries of ``input_ids``, before the step), so the batch stays
        valid for the step.
        """
        return AttentionBatch(self.is_prefill, self.seq_lens, self.query_lens, self.page_tables, len(self.input_ids))


_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
_param_values = attrgetter(*_PARAM_FIELDS)


def _param_object(values: tuple) -> SamplingParams:
    """A SamplingParams from already validated field values (no re-validation on every rank)."""
    params = object.__new__(SamplingParams)
    params.__dict__.update(zip(_PARAM_FIELDS, values))
    return params


def _unpack_step_message(is_prefill, input_ids, positions, seq_lens, query_lens, page_tables, logits_rows,
                         unique_params, param_index, seeds, steps, return_logits, from_previous,
                         penalties, prompt_logprobs, mixed=False) -> StepMessage:
    objects = [_param_object(v) for v in unique_params]
    return StepMessage(is_prefill, input_ids, positions, seq_lens, query_lens, page_tables, logits_rows,
                       [objects[i] for i in param_index], seeds, steps, return_logits, from_previous, penalties,
                       prompt_logprobs, mixed=mixed)


@dataclass
class StepResult:
    """What a step returns to the scheduler: sampled tokens (and logits when asked for)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    #: the sampled rows' most likely tokens, ``(ids, logprobs)``: two lists of rows, each row the
    #: ``MAX_TOP_LOGPROBS`` int32 ids / float32 log-probabilities as ``bytes``, most likely first
    #: (:func:`worker.sampling.packed_rows.row_bytes`); None unless some row asked for alternatives
    top_logprobs: tuple[list[bytes], list[bytes]] | None = None
    #: a prefill step's prompt log-probabilities in the order of its message's ``prompt_logprobs``:
    #: (logprobs, alternatives' ids rows, their logprobs rows); None when it computed none
    prompt_logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None
    logits: object = None  # (sampled rows, vocab) float32 CPU tensor when return_logits
    rank_s: float = 0.0  # seconds the (first) rank spent in Worker.execute, timed on that rank
    wait_s: float = 0.0  # of which waiting for the device to finish the step (0 on a CPU)
    wait_cpu_s: float = 0.0  # the waiting thread's CPU seconds during ``wait_s``


def build_step_message(batch: ScheduledBatch, seeds: list[int], return_logits: bool = False,
                       previous_rows: dict[int, int] | None = None) -> StepMessage:
    """Flatten a scheduled batch; ``seeds`` are those of the rows that sample, in order.

    A request with a token in flight (``num_pending``) gets a stand-in input (0) overwritten by the
    ranks from the previous step's sampled row ``previous_rows[id(request)]``. A mixed batch is laid
    out as a prefill batch: its decode rows are one-token requests (their input token possibly in
    flight) whose one row samples.
    """
    msg = (_decode_message if not batch.is_prefill else _prefill_message)(batch, seeds, return_logits, previous_rows)
    msg.mixed = batch.is_mixed
    penalized = [(row, req) for row, req in enumerate(r for r, s in zip(batch.requests, batch.sample) if s)
                 if req.params.penalized]
    if penalized:
        msg.penalties = penalty_history(penalized)
    return msg


def penalty_history(penalized: list) -> tuple:
    """:attr:`StepMessage.penalties` of ``(sampled row, request)`` pairs: the rows, then int64 arrays
    (a request keeps its outputs and distinct prompt ids as arrays, so a step concatenates them)."""
    rows = [row for row, _ in penalized]
    outputs = [req.output_array() for _, req in penalized]
    prompts = [(row, req.distinct_prompt_ids()) for row, req in penalized if req.params.repetition_penalty != 1]

    def columns(row_ids: list[int], arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if not arrays:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return (np.repeat(np.asarray(row_ids, dtype=np.int64), [len(a) for a in arrays]),
                np.concatenate(arrays))

    return (rows, *columns(rows, outputs), *columns([r for r, _ in prompts], [a for _, a in prompts]))


def _prefill_message(batch: ScheduledBatch, seeds: list[int], return_logits: bool,
                     previous_rows: dict[int, int] | None) -> StepMessage:
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    params: list[SamplingParams] = []
    steps: list[int] = []
    from_previous: list[tuple[int, int]] = []
    scored: list[tuple] = []
    scored_at: list[int] = []
    scored_tokens: list[int] = []
    width = 0
    for req, start, n, sample_row in zip(batch.requests, batch.start, batch.num_new, batch.sample):
        if req.params.prompt_logprobs is not None:
            first, count = _prompt_positions(req, start, n)
            if count:
                scored.append((req, first, count))
                scored_at.extend(range(len(ids) + first - start, len(ids) + first - start + count))
                scored_tokens.extend(req.prompt_ids[first + 1: first + 1 + count])
                width = max(width, MAX_TOP_LOGPROBS if req.params.prompt_logprobs else 0)
        known = req.tokens(start, start + n)
        ids.extend(known)
        if len(known) < n:  # only the last token can be in flight (one step ahead at most)
            if previous_rows is None or n - len(known) != 1 or id(req) not in previous_rows:
                raise ValueError(f"request {req.request_id}: input token {start + n - 1} is not known and no "
                                 "step in flight samples it")
            from_previous.append((len(ids), previous_rows[id(req)]))
            ids.append(0)
        positions.extend(range(start, start + n))
        if sample_row:
            rows.append(len(ids) - 1)
            params.append(req.params)
            steps.append(len(req.output_ids) + req.num_pending)
    msg = StepMessage(batch.is_prefill, ids, positions, [s + n for s, n in zip(batch.start, batch.num_new)],
                      list(batch.num_new), PageRows.gather([r.pages for r in batch.requests]), rows, params,
                      list(seeds), steps, return_logits, from_previous)
    if scored:
        msg.prompt_logprobs, msg.scored_prompts = (width, scored_at, scored_tokens), scored
    return msg


def _prompt_positions(req, start: int, n: int) -> tuple[int, int]:
    """The prompt positions a chunk of ``n`` tokens from ``start`` scores for ``req`` (position p
    scores prompt token p + 1): (first, count). A prefill from position 0 (the first, or one after
    a preemption) starts again from what was read back; positions already asked for are not."""
    if start == 0:
        req.prompt_logprob_next = len(req.prompt_logprobs)
    first = max(start, req.prompt_logprob_next)
    end = min(start + n, len(req.prompt_ids) - 1)
    if end <= first:
        return first, 0
    req.prompt_logprob_next = end
    return first, end - first


def _decode_message(batch: ScheduledBatch, seeds: list[int], return_logits: bool,
                    previous_rows: dict[int, int] | None) -> StepMessage:
    """:func:`build_step_message` of a decode batch: one input token and one sampled row per request,
    the request's last token, whose position is ``start``."""
    if any(n != 1 for n in batch.num_new) or not all(batch.sample):
        raise ValueError("a decode batch has one new, sampled token per request")
    ids: list[int] = []
    from_previous: list[tuple[int, int]] = []
    steps: list[int] = []
    for row, (req, start) in enumerate(zip(batch.requests, batch.start)):
        out, pending = req.output_ids, req.num_pending
        k = start - len(req.prompt_ids)  # the input token's index among the outputs
        if 0 <= k < len(out):
            ids.append(out[k])
        elif k < 0:
            ids.append(req.prompt_ids[k])
        else:  # only the last token can be in flight (one step ahead at most)
            if previous_rows is None or k != len(out) or id(req) not in previous_rows:
                raise ValueError(f"request {req.request_id}: input token {start} is not known and no "
                                 "step in flight samples it")
            from_previous.append((row, previous_rows[id(req)]))
            ids.append(0)
        steps.append(len(out) + pending)
    n = len(ids)
    return StepMessage(False, ids, list(batch.start), [s + 1 for s in batch.start], [1] * n,
                       PageRows.gather([r.pages for r in batch.requests]), list(range(n)),
                       [r.params for r in batch.requests], list(seeds), steps, return_logits, from_previous)
