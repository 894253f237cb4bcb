"""Test harness around our model for comparisons with HF transformers (no engine, no sampling)."""

from __future__ import annotations

import torch

from graphs.eager import EagerRunner
from worker.attention.factory import create_attention_backend
from worker.kv_cache import KVCacheShape, PageAllocator, PagedKVCache
from worker.model.loader import load_model
from worker.model_runner import ModelRunner
from worker.request import Request
from worker.sampling.params import SamplingParams
from worker.scheduler import ScheduledBatch
from worker.step_message import build_step_message


def rope_reference(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, heads: int,
                   head_dim: int) -> torch.Tensor:
    """NeoX RoPE of ``x`` (tokens, heads*D) at ``positions`` from a ``cos_sin_cache`` table, in
    float32, as (tokens, heads, D): the reference of our Triton RoPE kernels."""
    cos, sin = table[positions.long()].chunk(2, dim=-1)
    x = x.float().view(x.shape[0], heads, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), dim=-1)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference magnitude."""
    ours, ref = ours.float().cpu(), ref.float().cpu()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref||_2 / ||ref||_2: the bf16 comparison metric.

    Max-based error is dominated by single-ulp flips of the largest bf16 logits (one bf16 ulp
    at |x| = 4..8 is 0.03, i.e. ~0.5% of the max); the norm-based error measures the whole vector.
    """
    ours, ref = ours.float().cpu(), ref.float().cpu()
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-12)).item()


class OwnModel:
    """Our model over our paged KV cache; steps return logits for every token in the batch."""

    def __init__(self, model_dir, dtype=torch.float32, device="cpu", backend="torch",
                 num_pages=256, page_size=16, kernels=None, max_rows=64, max_pages_per_row=None,
                 fused_rope_store=None, fused_decode=False):
        device = torch.device(device)
        self.model, self.arch = load_model(model_dir, dtype, device, kernels=kernels)
        shape = self.model.attention_shape
        self.cache = PagedKVCache(KVCacheShape(self.arch.num_layers, num_pages, page_size, shape.num_kv_heads,
                                               self.arch.head_dim), dtype, device)
        # fused_rope_store and decode_graph_split_kv as the Worker's defaults unless a test says
        extra = {} if backend == "torch" else {"decode_graph_split_kv": "auto", "fused_decode": fused_decode}
        self.attention = create_attention_backend(backend, shape, self.cache, max_rows, 4096,
                                                  max_pages_per_row or num_pages,
                                                  fused_rope_store=backend != "torch" if fused_rope_store is None
                                                  else fused_rope_store, **extra)
        self.runner = ModelRunner(self.model, self.attention, EagerRunner("decode", "disabled"),
                                  EagerRunner("prefill", "disabled"))
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size

    def new_request(self, ids: list[int], rid: int) -> Request:
        return Request(str(rid), list(ids), SamplingParams(), 0, rid)

    def step(self, reqs: list[Request], num_new: list[int], is_prefill: bool) -> torch.Tensor:
        """Run ``num_new[i]`` next tokens of each request; returns logits (tokens, vocab) float32."""
        for r, n in zip(reqs, num_new):
            r.pages.extend(self.allocator.allocate(r.pages_needed(r.num_computed + n, self.page_size)))
        batch = ScheduledBatch(is_prefill, reqs, [r.num_computed for r in reqs], num_new, [True] * len(reqs))
        hidden = self.runner.forward(self.runner.prepare(build_step_message(batch, [0] * len(reqs))))
        for r, n in zip(reqs, num_new):
            r.num_computed += n
        return self.model.compute_logits(hidden)


def prefill_then_greedy(own: OwnModel, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list]:
    """One prefill step of ``prompts``, then ``steps`` greedy decode steps of every request; returns
    (the logits of every step, the greedy tokens of each decode step)."""
    reqs = [own.new_request(p, i) for i, p in enumerate(prompts)]
    logits = [own.step(reqs, [len(p) for p in prompts], is_prefill=True)]
    last = [logits[0][e - 1] for e in torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()]
    tokens = []
    for _ in range(steps):
        for r, lg in zip(reqs, last):
            r.output_ids.append(int(lg.argmax()))
        tokens.append([r.output_ids[-1] for r in reqs])
        logits.append(own.step(reqs, [1] * len(reqs), is_prefill=False))
        last = list(logits[-1])
    return logits, tokens


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """HF transformers' logits (len(ids), vocab) for one unpadded sequence."""
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        return hf_model(torch.tensor([ids], device=device)).logits[0].float()
