"""Presence, frequency and repetition penalties on the device, as vLLM applies them.

For a penalized row, with ``count[t]`` the occurrences of token ``t`` among the row's output tokens so
far and ``seen[t]`` whether ``t`` is in its prompt or its output so far:

    logit[t] = logit[t] / r if logit[t] > 0 else logit[t] * r     where seen[t]   (repetition, r)
    logit[t] -= frequency * count[t] + presence * (count[t] > 0)

after ``logit_bias`` and before temperature, greedy rows included. Rows without penalties hold
the neutral values (0, 0, 1) and no tokens, so the batched update leaves them exactly as they were.

Where the counts come from (owner: :func:`worker.step_message.build_step_message` and
:meth:`worker.model_runner.ModelRunner.execute`): every output token the engine has read back is
in the step message as a (sampled row, token id) pair, and the one token a request may have in
flight under async scheduling is that request's input of this step, which the ranks already hold
on the device (:attr:`PenaltyHistory.inflight_positions`): the counts are exact without a host
sync, whichever step is in flight. Building the counts costs one (rows, vocab) float32 buffer a
step with penalties, and host work proportional to the penalized rows' output lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PenaltyHistory:
    """A step's host-side penalty inputs: (sampled row, token id) columns of the output tokens read
    back, of the distinct prompt tokens of rows with a repetition penalty, and, for a row whose
    last output is in flight, its row and the index of that token among the step's input ids."""

    output_rows: np.ndarray
    output_tokens: np.ndarray
    prompt_rows: np.ndarray
    prompt_tokens: np.ndarray
    inflight_rows: np.ndarray
    inflight_positions: np.ndarray

    @classmethod
    def of(cls, penalties: tuple | None, logits_rows: list[int], from_previous: list[tuple[int, int]]
           ) -> PenaltyHistory:
        """The history of a step message's ``penalties`` (None: nothing counted); a penalized row's
        token is in flight when its logits row (its last input) is one of ``from_previous``."""
        def ints(values) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)

        if penalties is None:
            return cls(*(ints(()) for _ in range(6)))
        rows, out_rows, out_tokens, prompt_rows, prompt_tokens = penalties
        waiting = {position for position, _ in from_previous}
        inflight = [(row, logits_rows[row]) for row in rows if logits_rows[row] in waiting]
        return cls(ints(out_rows), ints(out_tokens), ints(prompt_rows), ints(prompt_tokens),
                   ints([r for r, _ in inflight]), ints([p for _, p in inflight]))

    def parts(self) -> list[np.ndarray]:
        """The six columns, in field order (what the sampling batch stages)."""
        return [self.output_rows, self.output_tokens, self.prompt_rows, self.prompt_tokens, self.inflight_rows,
                self.inflight_positions]


@dataclass(frozen=True)
class Penalties:
    """Device tensors of a step's penalties: per row ``presence``, ``frequency``, ``repetition``
    (float32, (B,)); token columns as :class:`PenaltyHistory`, the in-flight tokens already
    gathered from the step's input ids; ``repetition_any``: some row has a repetition penalty."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_rows: torch.Tensor
    output_tokens: torch.Tensor
    prompt_rows: torch.Tensor
    prompt_tokens: torch.Tensor
    inflight_rows: torch.Tensor
    inflight_tokens: torch.Tensor
    repetition_any: bool


def apply_penalties_(logits: torch.Tensor, p: Penalties) -> None:
    """Penalize ``logits`` (B, V) float32 in place (see the module docstring). Device work only."""
    counts = torch.zeros_like(logits)
    for rows, tokens in ((p.output_rows, p.output_tokens), (p.inflight_rows, p.inflight_tokens)):
        if rows.numel():
            counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=logits.dtype), accumulate=True)
    present = counts > 0
    if p.repetition_any:
        seen = present.clone()
        if p.prompt_rows.numel():
            seen.index_put_((p.prompt_rows, p.prompt_tokens), torch.ones_like(p.prompt_rows, dtype=torch.bool))
        r = p.repetition[:, None]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    logits.sub_(counts.mul_(p.frequency[:, None]).add_(present.to(logits.dtype).mul_(p.presence[:, None])))
