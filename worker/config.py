"""What a worker and its engine are configured with: the model, attention, cache and scheduler
sections, and :class:`EngineConfig` composing them with the ``graphs`` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from configkit import Section, check, check_min
from graphs.config import GraphsConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackend = Literal["auto", "torch", "flashinfer"]
FlashInferKernel = Literal["fa2", "fa3"]


@dataclass(frozen=True)
class ModelConfig(Section):
    """The checkpoint to serve.

    path: checkpoint directory; None = not configured.
    dtype: weight and activation dtype; "auto" = bfloat16 on CUDA, float32 on CPU.
    device: "auto" = CUDA when available, else CPU.
    max_model_len: longest sequence (prompt + output) in tokens; None = from the checkpoint.
    seed: random seed for sampling and initialisation.
    """

    path: str | None = None
    dtype: Dtype = "auto"
    device: Device = "auto"
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_min(self.max_model_len, "max_model_len", 1)

    def resolved_device(self, cuda_available: bool) -> Literal["cpu", "cuda"]:
        """``device`` with "auto" resolved."""
        if self.device == "auto":
            return "cuda" if cuda_available else "cpu"
        return self.device

    def resolved_dtype(self, device: Literal["cpu", "cuda"]) -> str:
        """``dtype`` with "auto" resolved for ``device`` (a torch dtype name)."""
        if self.dtype == "auto":
            return "bfloat16" if device == "cuda" else "float32"
        return self.dtype


@dataclass(frozen=True)
class AttentionConfig(Section):
    """Attention kernels.

    backend: attention kernels; "auto" picks per device.
    fast_decode_plan: flashinfer only: re-plan a captured decode shape through flashinfer's
        scheduler alone (vLLM's and SGLang's fast_decode_plan), skipping its Python plan's checks
        and copies (on the H200 at batch 64: 209 against 353-515 us of host time a step).
    fused_rope_store: flashinfer only: one Triton kernel rotates q and k and writes k and v into
        the KV cache (worker/attention/rope_store.py), instead of flashinfer's RoPE kernel and then
        its KV append; off, or where Triton does not import, the two kernels run. On the H200
        (decode-20261203T223136, context 512) the full decode graph of tinyllama-1.1b is 1.19x /
        1.09x faster with it at batch 1 / 64, llama-3-8b's 1.01x.
    decode_graph_split_kv: flashinfer only: whether captured decode shapes split each row's KV and
        merge the parts (flashinfer's graph mode: a long row is spread over many CTAs); off, one CTA
        per row and KV head reads a row's whole KV and no merge kernel runs. "auto" decides per
        captured shape: split while rows x KV heads (the CTAs of an unsplit pass) are fewer than the
        GPU's SMs, not once they fill them. Measured at context 512 (decode-20261204T013500):
        unsplit was 4-5% faster at batch 64 and 256 on tinyllama-1.1b (4 KV heads), a wash on
        llama-3-8b (8 KV heads), and 1.5-10% slower at batch 1 and 8. Unsplit, a long row in a big
        batch of short ones is read by few CTAs: the cost "auto" accepts where the batch fills the GPU.
    prefill_kernel, decode_kernel: flashinfer only: the kernel family of prefill and of
        (tensor-core) decode attention, flashinfer's ``backend``: "fa2" (FlashAttention-2 style,
        every GPU) or "fa3" (FlashAttention-3 style, Hopper only: TMA and warpgroup MMA; its
        first use JIT-compiles where flashinfer's cache lacks it). fa3 decode re-plans through
        flashinfer's own plan (the fast plan reproduces fa2's). "fa2" until bench/decode_breakdown.py
        and bench/prefill.py measure fa3 faster on the GPU.
    fused_decode: flashinfer only: a decode step's attention runs as one Triton kernel a layer
        (worker/attention/fused_decode.py: RoPE, the KV write and paged attention, the KV split
        merged inside), where the default launches three at small batches (the fused RoPE + KV
        write, flashinfer's attention and its merge). Off until bench/decode.py
        (``full_fused_decode``) measures it faster on the GPU; breakable decode graphs keep
        flashinfer's attention in their eager breaks either way.
    """

    backend: AttentionBackend = "auto"
    fast_decode_plan: bool = True
    fused_rope_store: bool = True
    decode_graph_split_kv: bool | Literal["auto"] = "auto"
    prefill_kernel: FlashInferKernel = "fa2"
    decode_kernel: FlashInferKernel = "fa2"
    fused_decode: bool = False


@dataclass(frozen=True)
class CacheConfig(Section):
    """The paged KV cache.

    page_size: tokens per page (a power of two).
    num_pages: total pages including the reserved dummy page 0; None = sized automatically.
    gpu_memory_fraction: this worker's own share of its GPU (weights + cache + graphs), in (0, 1].
    cpu_num_pages: pages allocated on CPU when num_pages is None.
    prefix_caching: automatic prefix caching (vLLM's and SGLang's): full pages stay cached after
        their requests end, keyed by a hash chained over their tokens (worker/prefix_hash.py), and a
        request whose prompt starts with cached pages shares them and prefills only the rest;
        cached pages no request holds are evicted least recently used first, only when free pages
        run out (worker/prefix_cache.py). Outputs are the same either way.
    """

    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_fraction: float = 0.85
    cpu_num_pages: int = 2048
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        p = self.page_size
        check(p >= 1 and p & (p - 1) == 0, "page_size", f"must be a power of two >= 1, got {p}")
        check_min(self.num_pages, "num_pages", 2)
        f = self.gpu_memory_fraction
        check(0 < f <= 1, "gpu_memory_fraction", f"must be in (0, 1], got {f!r}")
        check_min(self.cpu_num_pages, "cpu_num_pages", 2)


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """Request admission and batching: prefill chunks, decode batches and mixed steps of both
    (worker/scheduler.py).

    max_running_requests: requests admitted at once; bounds a decode batch (one token per request).
    max_num_batched_tokens: token budget of a step with prefill work, which computes at most
        min(this, chunked_prefill_size) tokens, decode rows of a mixed step included (a
        decode-only batch, one token per running request, is bounded by max_running_requests, not
        by this). Also sizes the activation reserve and the attention buffers.
    chunked_prefill_size: most prompt tokens one prefill step computes, over all its requests;
        longer prompts are split into chunks over several steps (<= max_num_batched_tokens).
    max_waiting_requests: queued requests before new ones are rejected.
    async_scheduling: schedule and send step N+1 before reading step N's tokens back (vLLM's
        ``--async-scheduling``): a rank takes a decode row's input token from the tokens it sampled
        in the step before, so the hop to the ranks and the engine's host work overlap the ranks'
        compute. With a local worker it changes only the order of host work (a step runs when its
        tokens are read). Never on the prefill groups of a disaggregated fleet. A request that
        stops on EOS or a stop string has computed one token more, which is dropped. On by default
        (as SGLang's overlap scheduler and vLLM's async scheduling): faster than synchronous at every
        batch measured, in-process and through a fleet group (bench/results/actor_overhead-20261202T151520.json).
    mixed_steps: while requests decode and prefill work waits, a step carries every decode row (one
        token each) and a prefill chunk filling the rest of the token budget (vLLM's chunked
        prefill, SGLang's mixed chunk), run by the prefill runner; off, a step is either a prefill
        chunk or a decode batch and prefill goes first, so every running stream waits for whole
        prefill steps while prompts arrive. The bound mixed steps give: a running stream that is
        not preempted gets a token every step, and a step computes at most
        min(max_num_batched_tokens, chunked_prefill_size) tokens, or its decode rows plus
        mixed_prefill_tokens when that is set. A step with decodes only still replays the decode graph.
    mixed_prefill_tokens: most prompt tokens a step that carries decode rows computes; lower it to
        shorten the steps a running stream waits through while prompts arrive (prompts then take
        more steps to prefill); None = all the budget the decode rows leave.
    defer_shared_prefixes: with cache.prefix_caching, a waiting request whose next full page to
        compute is one that an earlier request in the same step computes waits a step (keeping its
        place in the queue) and then finds the page cached, so prompts sharing a prefix that arrive
        together compute it once (SGLang's in-batch prefix caching check). A request waits only
        while a chunk of the step being scheduled writes that page, so it never waits for a request
        that is aborted, preempted or done with the shared pages.
    """

    max_running_requests: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 8192
    max_waiting_requests: int = 4096
    async_scheduling: bool = True
    mixed_steps: bool = True
    mixed_prefill_tokens: int | None = None
    defer_shared_prefixes: bool = True

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_num_batched_tokens", "chunked_prefill_size", "max_waiting_requests"):
            check_min(getattr(self, name), name, 1)
        check_min(self.mixed_prefill_tokens, "mixed_prefill_tokens", 1)
        check(
            self.chunked_prefill_size <= self.max_num_batched_tokens,
            "chunked_prefill_size",
            f"{self.chunked_prefill_size} exceeds max_num_batched_tokens ({self.max_num_batched_tokens}); "
            "a prefill chunk must fit in one step, so lower chunked_prefill_size or raise max_num_batched_tokens",
        )


@dataclass(frozen=True)
class EngineConfig(Section):
    """What a :class:`worker.engine.Engine` and its :class:`worker.worker.Worker` are configured with.

    model, attention, cache, scheduler, graphs: the sections above and :class:`graphs.config.GraphsConfig`.
    Checks across sections: a captured prefill ladder reaches ``scheduler.chunked_prefill_size``.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)

    def __post_init__(self) -> None:
        chunk = self.scheduler.chunked_prefill_size
        prefill = self.graphs.prefill
        if not self.graphs.uses_prefill_graphs:
            return
        if prefill.token_buckets:
            key, ceiling = "graphs.prefill.token_buckets", prefill.token_buckets[-1]
        elif prefill.max_tokens is not None:
            key, ceiling = "graphs.prefill.max_tokens", prefill.max_tokens
        else:
            return  # max_tokens defaults to the chunk size
        check(
            ceiling >= chunk,
            key,
            f"largest captured prefill size {ceiling} is below scheduler.chunked_prefill_size ({chunk}); "
            "the largest prefill chunk would otherwise stay eager and keep its activation peak. "
            f"Raise {key} or lower scheduler.chunked_prefill_size",
        )
