"""The ``graphs`` section: CUDA graphs for decode and prefill, the capture set and the graph budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from configkit import ConfigError, Section, check, check_ladder, check_min, parse_bytes

DecodeBackend = Literal["full", "breakable", "tc_full", "eager", "debug"]
PrefillBackend = Literal["breakable", "full", "tc_piecewise", "eager", "debug"]
CaptureMode = Literal["both", "decode", "prefill", "none"]


@dataclass(frozen=True)
class DecodeGraphConfig(Section):
    """CUDA graphs for decode steps.

    backend: how decode steps run: "full" or "breakable" graphs, "tc_full" (one full graph per
        shape of a torch.compile'd forward, attention an opaque op; a failed compile falls back to
        "full" and counts in cuda_graph_compile_failures_total), "eager" (no graph), or "debug".
        "full" is the default for every preset: on the H200 (decode-20261204T122602) tc_full was
        1.04-1.06x full's step on tinyllama-1.1b and 0.996-1.010x on llama-3-8b, and costs a
        20-28 s compile.
    max_batch_size: largest captured batch; larger batches run eager.
    batch_sizes: captured batch sizes, strictly increasing; None = the default ladder up to max_batch_size.
    padding: pad a batch up to the next captured size (else only exact sizes replay).
    """

    backend: DecodeBackend = "full"
    max_batch_size: int = 256
    batch_sizes: tuple[int, ...] | None = None
    padding: bool = True

    def __post_init__(self) -> None:
        check_min(self.max_batch_size, "max_batch_size", 1)
        check_ladder(self.batch_sizes, "batch_sizes")
        if self.batch_sizes:
            check(
                self.batch_sizes[-1] <= self.max_batch_size,
                "batch_sizes",
                f"largest size {self.batch_sizes[-1]} exceeds max_batch_size ({self.max_batch_size})",
            )


@dataclass(frozen=True)
class PrefillGraphConfig(Section):
    """CUDA graphs for prefill chunks, captured per token bucket.

    backend: how prefill chunks run: "breakable", "full" or "tc_piecewise" graphs, "eager" (no graph), or "debug".
    token_buckets: captured token counts, strictly increasing; None = default ladder up to max_tokens.
    max_tokens: largest captured bucket; None = scheduler.chunked_prefill_size.
    num_request_slots: request rows per captured prefill shape; a step with more rows runs eagerly
        (too_many_requests). None = scheduler.max_running_requests with mixed steps on (a mixed step
        has a row per running request: its decode rows and its prefill chunks), else
        max(1, chunked_prefill_size // 512) capped at max_running_requests. Each slot costs a (hidden,)
        row of the static output and a row of every plan (sentinel rows are empty: flashinfer
        schedules no work for them).
    max_padding_ratio: replay a bucket only if bucket / actual tokens <= this, else run eager (>= 1).
    mlp_chunk_tokens: inside prefill graphs (and the debug backend's runner path), each layer's MLP
        runs over row chunks of at most this many tokens, so its gate/up and SiLU activations, the
        largest of a layer, are a chunk's and the graph pool holds that much less (graphs/DESIGN.md,
        "How the pool grows"); a graph replays the extra kernels without launching them one by one.
        None = the whole batch at once. Eager prefill and tc_piecewise run the MLP whole.
    """

    backend: PrefillBackend = "breakable"
    token_buckets: tuple[int, ...] | None = None
    max_tokens: int | None = None
    num_request_slots: int | None = None
    max_padding_ratio: float = 2.0
    mlp_chunk_tokens: int | None = 2048

    def __post_init__(self) -> None:
        check_ladder(self.token_buckets, "token_buckets")
        check_min(self.mlp_chunk_tokens, "mlp_chunk_tokens", 1)
        check_min(self.max_tokens, "max_tokens", 1)
        if self.token_buckets and self.max_tokens is not None:
            check(
                self.token_buckets[-1] <= self.max_tokens,
                "token_buckets",
                f"largest bucket {self.token_buckets[-1]} exceeds max_tokens ({self.max_tokens})",
            )
        check_min(self.num_request_slots, "num_request_slots", 1)
        check_min(self.max_padding_ratio, "max_padding_ratio", 1)

    def resolved_max_tokens(self, chunked_prefill_size: int) -> int:
        """``max_tokens`` with None resolved (largest token bucket, else the prefill chunk size)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return self.token_buckets[-1] if self.token_buckets else chunked_prefill_size

    def resolved_num_request_slots(self, chunked_prefill_size: int, max_running_requests: int | None = None,
                                   mixed_steps: bool = False) -> int:
        """``num_request_slots`` with None resolved: with ``mixed_steps`` the most rows a mixed step has
        (``max_running_requests``), else ``max(1, chunked_prefill_size // 512)``, never more than
        ``max_running_requests`` (a prefill step has at most that many requests: more slots would be
        sentinels in every replay)."""
        if self.num_request_slots is not None:
            return self.num_request_slots
        if mixed_steps and max_running_requests is not None:
            return max_running_requests
        slots = max(1, chunked_prefill_size // 512)
        return slots if max_running_requests is None else min(slots, max_running_requests)


@dataclass(frozen=True)
class GraphsConfig(Section):
    """CUDA graph capture and replay.

    enabled: master switch; False runs every step eager.
    debug: run both phases with the "debug" backend, whatever decode.backend and prefill.backend
        say (even "eager"): the runners' replay path (static buffers, padding, metadata planning)
        with no graph, on any device. enabled and capture still decide which phases use a runner.
    decode: decode graphs.
    prefill: prefill graphs.
    capture: which phases are captured.
    memory_budget: cap on graph memory: int = bytes, float in (0, 1] = fraction of free memory,
        str = size such as "4GiB"; None = no cap.
    profile: path of a batch-shape profile (JSON, as written by ``graphfleet profile export`` or
        ``graphfleet generate --profile-out``; read with ``graphs.profile.BatchProfile.load``): the
        captured ladders are planned from the batch shapes it counts (graphs.planner), within
        memory_budget or, with no budget, the memory the default ladders would take; None = no profile.
    capture_timeout_s: abort capture after this many seconds (> 0).
    replan_interval_s: how often a serving group looks at the batches it has run since its graphs
        were last planned; when a phase's graph replays padded more than replan_padding_share of
        their rows (decode) or tokens (prefill) over at least 32 steps, it re-plans its ladders
        between two steps, as ``POST /admin/replan`` does (each re-plan that fires doubles the
        interval until a look finds no drift). None = only on request.
    replan_padding_share: the padding share in (0, 1) that triggers an automatic re-plan.
    warm_up_in_pool: each backend's warm-ups after its first capture run inside the graph pool,
        on the blocks captured graphs leave free, so capture holds no activation peak beside the
        graphs; false runs every warm-up outside the pool (graphs.backends).
    """

    enabled: bool = True
    debug: bool = False
    decode: DecodeGraphConfig = field(default_factory=DecodeGraphConfig)
    prefill: PrefillGraphConfig = field(default_factory=PrefillGraphConfig)
    capture: CaptureMode = "both"
    memory_budget: int | float | str | None = None
    profile: str | None = None
    capture_timeout_s: float = 600.0
    replan_interval_s: float | None = None
    replan_padding_share: float = 0.1
    warm_up_in_pool: bool = True

    def __post_init__(self) -> None:
        budget = self.memory_budget
        if isinstance(budget, float):
            check(0 < budget <= 1, "memory_budget",
                  f"a float is a fraction of free memory and must be in (0, 1], got {budget!r}")
        elif isinstance(budget, (int, str)):
            try:
                nbytes = parse_bytes(budget)
            except ValueError as exc:
                raise ConfigError(str(exc), key="memory_budget") from None
            check(nbytes > 0, "memory_budget", f"must be > 0 bytes, got {budget!r}")
        t = self.capture_timeout_s
        check(t > 0, "capture_timeout_s", f"must be > 0, got {t!r}")
        r = self.replan_interval_s
        check(r is None or r > 0, "replan_interval_s", f"must be > 0 seconds or null, got {r!r}")
        share = self.replan_padding_share
        check(0 < share < 1, "replan_padding_share", f"must be in (0, 1), got {share!r}")

    @property
    def uses_prefill_graphs(self) -> bool:
        """Whether prefill chunks are captured at all."""
        return self.enabled and self.capture in ("both", "prefill") and self.prefill.backend != "eager"

    def resolved_memory_budget(self, free_bytes: int) -> int | None:
        """``memory_budget`` in bytes given the currently free device memory; None = no cap."""
        if self.memory_budget is None:
            return None
        if isinstance(self.memory_budget, float):
            return int(self.memory_budget * free_bytes)
        return parse_bytes(self.memory_budget)
