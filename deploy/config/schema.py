"""The graphfleet configuration: one frozen dataclass per YAML section (the ``graphs`` section's
in :mod:`deploy.config.graphs_schema`).

Types are checked by the generic loader (:mod:`deploy.config.loader`); ranges and cross-field
rules live in each section's ``__post_init__``, which raises :class:`ConfigError` keyed by the
field name (the loader prefixes the section path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from deploy.config.checks import _check, _check_min, parse_bytes
from deploy.config.graphs_schema import (
    CaptureMode,
    DecodeBackend,
    DecodeGraphConfig,
    GraphsConfig,
    PrefillBackend,
    PrefillGraphConfig,
)
from deploy.config.loader import Section

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackend = Literal["auto", "torch", "flashinfer"]
ClusterMode = Literal["colocated", "disaggregated"]
KVTransport = Literal["object_store", "nccl", "cuda_ipc"]


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
        _check_min(self.max_model_len, "max_model_len", 1)

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
    """

    backend: AttentionBackend = "auto"


@dataclass(frozen=True)
class CacheConfig(Section):
    """The paged KV cache.

    page_size: tokens per page (a power of two).
    num_pages: total pages including the reserved dummy page 0; None = sized automatically.
    gpu_memory_fraction: this worker's own share of its GPU (weights + cache + graphs), in (0, 1].
    cpu_num_pages: pages allocated on CPU when num_pages is None.
    """

    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_fraction: float = 0.85
    cpu_num_pages: int = 2048

    def __post_init__(self) -> None:
        p = self.page_size
        _check(p >= 1 and p & (p - 1) == 0, "page_size", f"must be a power of two >= 1, got {p}")
        _check_min(self.num_pages, "num_pages", 2)
        f = self.gpu_memory_fraction
        _check(0 < f <= 1, "gpu_memory_fraction", f"must be in (0, 1], got {f!r}")
        _check_min(self.cpu_num_pages, "cpu_num_pages", 2)


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """Request admission and batching.

    max_running_requests: requests decoding concurrently.
    max_num_batched_tokens: tokens in one forward step (prefill + decode).
    chunked_prefill_size: longest prefill chunk; longer prompts are split (<= max_num_batched_tokens).
    max_waiting_requests: queued requests before new ones are rejected.
    async_scheduling: schedule and send step N+1 before reading step N's tokens back (vLLM's
        ``--async-scheduling``): a rank takes a decode row's input token from the tokens it sampled
        in the step before, so the hop to the ranks and the engine's host work overlap the ranks'
        compute. Off until measured on a GPU host (on the 2-core CPU machine the rank then
        competes with the engine's host work for the cores). With a local worker it changes only
        the order of host work (a step runs when its tokens are read). Never on the prefill groups
        of a disaggregated fleet. A request that stops on EOS or a stop string has computed one
        token more, which is dropped.
    """

    max_running_requests: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 8192
    max_waiting_requests: int = 4096
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_num_batched_tokens", "chunked_prefill_size", "max_waiting_requests"):
            _check_min(getattr(self, name), name, 1)
        _check(
            self.chunked_prefill_size <= self.max_num_batched_tokens,
            "chunked_prefill_size",
            f"{self.chunked_prefill_size} exceeds max_num_batched_tokens ({self.max_num_batched_tokens}); "
            "a prefill chunk must fit in one step, so lower chunked_prefill_size or raise max_num_batched_tokens",
        )


@dataclass(frozen=True)
class ClusterConfig(Section):
    """Worker topology.

    mode: "colocated" = prefill and decode on the same workers, "disaggregated" = separate pools.
    tp_size: tensor-parallel degree.
    step_timeout_s: a worker step slower than this is treated as a failure (> 0).
    start_timeout_s: bound on starting a group (placement, rendezvous, load, capture) (> 0).
    gpus_per_rank: GPUs each rank actor reserves on a GPU cluster (0 < x <= 1; fractions let
        several groups share one GPU for testing).
    restart: start a fresh group in the background when one dies.
    collectives_at_tp1: run the all-reduce even at tp_size 1 (a no-op on values) so one GPU can
        verify that NCCL collectives are captured inside graphs.
    compiled_graph: drive each group's steps through a Ray Compiled Graph (shared-memory
        channels, ~0.1 ms a step) instead of a Ray task per rank per step (~1-3 ms).
    num_prefill_groups, num_decode_groups: groups per role when mode is disaggregated (>= 1).
    prefill_tp_size, decode_tp_size: each role's tp degree; None = tp_size (equal for hand-off).
    kv_transport: how KV moves from prefill to decode ranks: "object_store" (anywhere), "cuda_ipc"
        (groups sharing one GPU), "nccl" (point-to-point between matching ranks; gloo on CPU).
    handoff_timeout_s: bound on one KV import into a decode group (> 0).
    lost_after_s: a dead group not back after this long is lost to its requests (> 0).
    max_attempts: prefills a request may take before group failures end it with an error (>= 1).
    """

    mode: ClusterMode = "colocated"
    tp_size: int = 1
    step_timeout_s: float = 60.0
    start_timeout_s: float = 900.0
    gpus_per_rank: float = 1.0
    restart: bool = True
    collectives_at_tp1: bool = False
    compiled_graph: bool = True
    num_prefill_groups: int = 1
    num_decode_groups: int = 1
    prefill_tp_size: int | None = None
    decode_tp_size: int | None = None
    kv_transport: KVTransport = "object_store"
    handoff_timeout_s: float = 60.0
    lost_after_s: float = 60.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        _check_min(self.tp_size, "tp_size", 1)
        _check(self.step_timeout_s > 0, "step_timeout_s", f"must be > 0, got {self.step_timeout_s!r}")
        _check(self.start_timeout_s > 0, "start_timeout_s", f"must be > 0, got {self.start_timeout_s!r}")
        _check(0 < self.gpus_per_rank <= 1, "gpus_per_rank", f"must be in (0, 1], got {self.gpus_per_rank!r}")
        for key in ("num_prefill_groups", "num_decode_groups", "prefill_tp_size", "decode_tp_size", "max_attempts"):
            _check_min(getattr(self, key), key, 1)
        for key in ("handoff_timeout_s", "lost_after_s"):
            _check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)!r}")


@dataclass(frozen=True)
class ServeConfig(Section):
    """The HTTP API server.

    host: listen address.
    port: listen port (1..65535).
    api_key: required bearer token; None = no authentication.
    model_name: model name reported by the API; None = the checkpoint directory name.
    request_timeout_s: default deadline of a request from submission; None = no deadline.
    gil_switch_interval_ms: the Serve replica's ``sys.setswitchinterval`` in ms; None = Python's 5 ms
        (the fleet loop thread may wait this long for the GIL behind the replica's HTTP loop).
    stream_batching_interval_ms: a streamed choice's tokens go out at most once per this many ms
        (the first token and the finish at once), several tokens to a chunk, as Ray Serve LLM's
        ``stream_batching_interval_ms``; 0 = every step's tokens as they come (vLLM's and SGLang's
        default). Each chunk costs the replica a JSON body and a message through Serve's proxy.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    request_timeout_s: float | None = None
    gil_switch_interval_ms: float | None = None
    stream_batching_interval_ms: float = 50.0

    def __post_init__(self) -> None:
        _check(bool(self.host), "host", "must not be empty")
        _check(1 <= self.port <= 65535, "port", f"must be in 1..65535, got {self.port}")
        _check(self.api_key != "", "api_key", "must not be empty (use null to disable authentication)")
        t = self.request_timeout_s
        _check(t is None or t > 0, "request_timeout_s", f"must be > 0 or null, got {t!r}")
        g = self.gil_switch_interval_ms
        _check(g is None or 0 < g <= 1000, "gil_switch_interval_ms", f"must be in (0, 1000] or null, got {g!r}")
        b = self.stream_batching_interval_ms
        _check(0 <= b <= 1000, "stream_batching_interval_ms", f"must be in [0, 1000], got {b!r}")


@dataclass(frozen=True)
class Config(Section):
    """The whole graphfleet configuration; build with :func:`load_config` or :meth:`from_dict`.

    model, attention, cache, scheduler, graphs, cluster, serve: the sections above.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

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
        _check(
            ceiling >= chunk,
            key,
            f"largest captured prefill size {ceiling} is below scheduler.chunked_prefill_size ({chunk}); "
            "the largest prefill chunk would otherwise stay eager and keep its activation peak. "
            f"Raise {key} or lower scheduler.chunked_prefill_size",
        )


__all__ = [
    "AttentionConfig", "CacheConfig", "CaptureMode", "ClusterConfig", "Config", "DecodeBackend", "DecodeGraphConfig",
    "GraphsConfig", "ModelConfig", "PrefillBackend", "PrefillGraphConfig", "SchedulerConfig", "ServeConfig",
    "parse_bytes",
]
