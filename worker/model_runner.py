"""Runs one step message on one rank: inputs to the device, forward (graph or eager), sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphs.decode import LiveDecodeBatch
from graphs.prefill import LivePrefillBatch
from graphs.profile import BatchProfile
from graphs.runner import PhaseRunner
from worker.attention.base import AttentionBackend, AttentionBatch
from worker.host_staging import PinnedStaging
from worker.model.llama import LlamaForCausalLM
from worker.sampling.logprob_graphs import LogprobGraphs
from worker.sampling.logprobs import fused_tail, logprobs_of
from worker.sampling.params import MAX_TOP_LOGPROBS
from worker.sampling.penalties import PenaltyHistory
from worker.sampling.sampler import SampleOutput, SamplingBatch, SamplingRows, sample
from worker.step_message import StepMessage


@dataclass
class StepInputs:
    """Device inputs of one step."""

    input_ids: torch.Tensor  # (tokens,) int64
    positions: torch.Tensor  # (tokens,) int64
    attention: AttentionBatch
    logits_rows: torch.Tensor  # (sampled rows,) int64 indices into the token dim


class ModelRunner:
    """Owns the model, its KV cache (through the attention backend) and sampling.

    Each phase runs through its runner: a graph runner replays when its predicate says so and
    runs the eager forward otherwise; a phase without graphs has the eager runner
    (:class:`graphs.eager.EagerRunner`). Either way the pass is counted with its mode or reason.
    A mixed step (decode rows and prefill chunks, ``StepMessage.mixed``) is a prefill step to the
    prefill runner, its decode rows one-token requests in its request slots, counted as ``mixed``;
    a decode-only step goes to the decode runner.
    ``execute`` returns device tensors; reading them (``.tolist()``) is the caller's host sync.

    With ``logprob_graphs`` (and a decode graph runner on a CUDA device) the sampler's
    log-probabilities replay from graphs over the decode runner's static logits
    (:class:`worker.sampling.logprob_graphs.LogprobGraphs`); otherwise they run eagerly.
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend,
                 decode_runner: PhaseRunner[LiveDecodeBatch, torch.Tensor],
                 prefill_runner: PhaseRunner[LivePrefillBatch, torch.Tensor], logprob_graphs: bool = False) -> None:
        self.model = model
        self.attention = attention
        self.device = model.device
        self.decode_runner = decode_runner
        self.prefill_runner = prefill_runner
        buffers = getattr(decode_runner, "buffers", None)  # a DecodeGraphRunner's static buffers
        self.logprob_graphs = LogprobGraphs(buffers.logits) \
            if logprob_graphs and buffers is not None and self.device.type == "cuda" else None
        if self.device.type == "cuda":  # the decode steps' log-probability kernels compiled and probed now
            vocab = buffers.logits.shape[1] if buffers is not None else model.arch.vocab_size
            for width in (0, min(MAX_TOP_LOGPROBS, vocab)):
                fused_tail(self.device, vocab, width)
        self.profile = BatchProfile()  # live batch shapes, for profile-guided ladders
        self._staging = PinnedStaging(self.device)  # the step's ids, positions and rows, in one copy
        self._sampling_staging = PinnedStaging(self.device)
        self._sampling_rows = SamplingRows()

    def release_graphs(self) -> None:
        """Release every graph of this runner (the log-probability graphs first: they read the
        decode runner's static logits)."""
        if self.logprob_graphs is not None:
            self.logprob_graphs.release()
        self.decode_runner.release()
        self.prefill_runner.release()

    def prepare(self, msg: StepMessage, previous: torch.Tensor | None = None) -> StepInputs:
        """The step's device inputs; ``msg.from_previous`` inputs are taken from ``previous`` (the
        device tokens of the step before) on the device, so nothing waits for that step."""
        where = msg.from_previous
        if where and previous is None:
            raise ValueError("the step takes inputs from the previous step's tokens, and there are none")
        n = len(where)
        if n and n == len(msg.input_ids) and all(i == r for i, r in where):
            # Every input is the previous step's token of the same row (a steady decode batch with
            # async scheduling): one slice copy instead of staging indices and gathering.
            ids, positions, rows = self._staging.stage([msg.input_ids, msg.positions, msg.logits_rows])
            ids.copy_(previous[:n])
        else:
            ids, positions, rows, into, take = self._staging.stage(
                [msg.input_ids, msg.positions, msg.logits_rows, [p for p, _ in where], [r for _, r in where]])
            if where:
                ids.index_copy_(0, into, previous.index_select(0, take).to(torch.int64))
        return StepInputs(ids, positions, msg.attention_batch(), rows)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states (tokens, hidden) for ``inputs``, eagerly; writes the step's KV."""
        self.attention.plan(inputs.attention)
        return self.model(inputs.input_ids, inputs.positions, self.attention)

    def decode_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (rows, vocab) of a decode step: graph replay when possible, else eager.

        A replayed result is a view of the runner's static output: consume it before the next step.
        """
        self.profile.record_decode(inputs.input_ids.shape[0])
        live = LiveDecodeBatch(inputs.input_ids, inputs.positions, inputs.attention)
        return self.decode_runner.run(live, lambda: self.model.compute_logits(self.forward(inputs)))

    def prefill_logits(self, inputs: StepInputs, num_requests: int, label: str = "prefill") -> torch.Tensor:
        """Float32 logits (sampled rows, vocab) of a prefill or mixed step (the rows of
        ``inputs.logits_rows``, in order); writes the step's KV. Graph replay when possible (the LM
        head inside the graph when the runner's graphs end in logits, else eagerly after it); the
        pass is counted under ``label`` (``prefill`` or ``mixed``).

        A replayed result may be a view of a runner's static output: consume it before the next step.
        """
        self.profile.record_prefill(inputs.input_ids.shape[0], num_requests)
        live = LivePrefillBatch(inputs.input_ids, inputs.positions, inputs.attention, num_requests,
                                inputs.logits_rows)

        def eager_hidden() -> torch.Tensor:
            return self.forward(inputs).index_select(0, inputs.logits_rows)

        if getattr(self.prefill_runner, "logits", False):
            return self.prefill_runner.run(live, lambda: self.model.compute_logits(eager_hidden()), label)
        return self.model.compute_logits(self.prefill_runner.run(live, eager_hidden, label))

    def execute(self, msg: StepMessage, previous: torch.Tensor | None = None,
                ) -> tuple[SampleOutput | None, torch.Tensor | None]:
        """Run one step (``previous``: see :meth:`prepare`); returns the sampled tokens (None if no
        row samples) and the logits used, on the device and possibly not yet computed.

        Replayed logits and log-probabilities, and a greedy decode step's token ids when its
        log-probabilities replay, are views of static buffers that the next step overwrites:
        enqueue their copy on this stream before the next step (as
        :meth:`worker.worker.Worker.launch` does) or clone them (the next step's inputs read the
        tokens in stream order, before its own sampling rewrites them)."""
        inputs = self.prepare(msg, previous)
        prompt = None
        if not msg.is_prefill:
            logits = self.decode_logits(inputs)
        else:  # a prefill step, or a mixed one (its decode rows are one-token requests)
            label = "mixed" if msg.mixed else "prefill"
            if msg.prompt_logprobs is None:
                logits = self.prefill_logits(inputs, msg.num_requests, label)
            else:  # every token's hidden state is needed: eager, counted with its reason
                self.profile.record_prefill(inputs.input_ids.shape[0], msg.num_requests)
                self.prefill_runner.record_eager("prompt_logprobs", label)
                every = self.forward(inputs)
                prompt = self._score_prompt(every, *msg.prompt_logprobs)
                logits = self.model.compute_logits(every.index_select(0, inputs.logits_rows)) \
                    if msg.logits_rows else None
            if not msg.logits_rows:
                if prompt is None:
                    return None, None
                empty = torch.empty(0, dtype=torch.int64, device=self.device)
                return SampleOutput(empty, None, prompt=prompt), None
        history = None if msg.penalties is None else PenaltyHistory.of(msg.penalties, msg.logits_rows,
                                                                       msg.from_previous)
        sb = SamplingBatch.build(msg.params, msg.seeds, msg.steps, self.device, staging=self._sampling_staging,
                                 rows=self._sampling_rows, history=history, input_ids=inputs.input_ids)
        out = sample(logits, sb, logprob_graphs=self.logprob_graphs)
        return (out if prompt is None else out._replace(prompt=prompt)), logits

    def _score_prompt(self, hidden: torch.Tensor, width: int, at: list[int], targets: list[int],
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of ``targets`` after the tokens at ``at`` (and the ``width`` most likely
        tokens there), from the unprocessed logits, a slice of positions at a time so the float32
        logits and their log-softmax stay under 512 MiB together whatever the prompt's length."""
        at_dev, target_dev = self._sampling_staging.stage([at, targets])
        vocab = self.model.arch.vocab_size
        step = max(1, (1 << 26) // vocab)
        parts = [logprobs_of(self.model.compute_logits(hidden.index_select(0, at_dev[begin: begin + step])),
                             target_dev[begin: begin + step], width)
                 for begin in range(0, len(at), step)]
        lps = torch.cat([lp for lp, _, _ in parts])
        if not width:
            none = torch.empty(len(at), 0, device=self.device)
            return lps, none.long(), none
        return lps, torch.cat([i for _, i, _ in parts]), torch.cat([v for _, _, v in parts])
