"""Runs one step message on one rank: inputs to the device, forward (graph or eager), sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphs.decode import DecodeGraphRunner, LiveDecodeBatch
from graphs.metrics import GraphMetrics
from graphs.prefill import LivePrefillBatch, PrefillGraphRunner
from graphs.profile import BatchProfile
from worker.attention.base import AttentionBackend, AttentionBatch
from worker.model.llama import LlamaForCausalLM
from worker.sampling.sampler import SampleOutput, SamplingBatch, sample
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

    Each phase goes through its graph runner when there is one and the runner's predicate says
    replay; every other step runs eagerly, and the pass is counted with its reason.
    ``execute`` returns device tensors; reading them (``.tolist()``) is the caller's host sync.
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend,
                 decode_graphs: DecodeGraphRunner | None = None, metrics: GraphMetrics | None = None,
                 decode_eager_reason: str = "disabled", prefill_graphs: PrefillGraphRunner | None = None,
                 prefill_eager_reason: str = "disabled") -> None:
        self.model = model
        self.attention = attention
        self.device = model.device
        self.decode_graphs = decode_graphs
        self.prefill_graphs = prefill_graphs
        self.metrics = metrics
        self.decode_eager_reason = decode_eager_reason
        self.prefill_eager_reason = prefill_eager_reason
        self.profile = BatchProfile()  # live batch shapes, for profile-guided ladders

    def prepare(self, msg: StepMessage) -> StepInputs:
        packed = torch.tensor([msg.input_ids, msg.positions], dtype=torch.int64).to(self.device, non_blocking=True)
        rows = torch.tensor(msg.logits_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return StepInputs(packed[0], packed[1], msg.attention_batch(), rows)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states (tokens, hidden) for ``inputs``, eagerly; writes the step's KV."""
        self.attention.plan(inputs.attention)
        return self.model(inputs.input_ids, inputs.positions, self.attention)

    def decode_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (rows, vocab) of a decode step: graph replay when possible, else eager.

        A replayed result is a view of the runner's static output: consume it before the next step.
        """
        self.profile.record_decode(inputs.input_ids.shape[0])
        if self.decode_graphs is not None:
            live = LiveDecodeBatch(inputs.input_ids, inputs.positions, inputs.attention)
            choice = self.decode_graphs.decide(live)
            if choice.replays:
                return self.decode_graphs.execute(live, choice)
            self.decode_graphs.record_eager(choice.reason)
        elif self.metrics is not None:
            self.metrics.record_pass("decode", None, self.decode_eager_reason)
        return self.model.compute_logits(self.forward(inputs))

    def prefill_hidden(self, inputs: StepInputs, num_requests: int) -> torch.Tensor:
        """Final hidden states (tokens, hidden) of a prefill step: graph replay when possible.

        A replayed result is a view of the runner's static output: consume it before the next step.
        """
        self.profile.record_prefill(inputs.input_ids.shape[0], num_requests)
        if self.prefill_graphs is not None:
            live = LivePrefillBatch(inputs.input_ids, inputs.positions, inputs.attention, num_requests)
            choice = self.prefill_graphs.decide(live)
            if choice.replays:
                return self.prefill_graphs.execute(live, choice)
            self.prefill_graphs.record_eager(choice.reason)
        elif self.metrics is not None:
            self.metrics.record_pass("prefill", None, self.prefill_eager_reason)
        return self.forward(inputs)

    def execute(self, msg: StepMessage) -> tuple[SampleOutput | None, torch.Tensor | None]:
        """Run one step; returns the sampled tokens (None if no row samples) and the logits used."""
        inputs = self.prepare(msg)
        if not msg.is_prefill:
            logits = self.decode_logits(inputs)
        else:
            hidden = self.prefill_hidden(inputs, msg.num_requests)
            if not msg.logits_rows:
                return None, None
            logits = self.model.compute_logits(hidden[inputs.logits_rows])
        sb = SamplingBatch.build(msg.params, msg.seeds, msg.steps, self.device)
        return sample(logits, sb), logits
