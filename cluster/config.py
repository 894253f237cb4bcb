"""What a worker group and its rank actors are configured with: the ``cluster`` section and
:class:`GroupConfig`, an :class:`worker.config.EngineConfig` with it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from configkit import Section, check, check_min
from worker.config import EngineConfig

ClusterMode = Literal["colocated", "disaggregated"]
KVTransport = Literal["object_store", "nccl", "cuda_ipc"]
Routing = Literal["prefix_aware", "least_loaded"]


@dataclass(frozen=True)
class ClusterConfig(Section):
    """Worker topology.

    mode: "colocated" = prefill and decode on the same workers, "disaggregated" = separate pools.
    tp_size: tensor-parallel degree.
    step_timeout_s: a worker step slower than this is treated as a failure (> 0).
    start_timeout_s: bound on starting a group (placement, rendezvous, load, capture) (> 0).
    gpus_per_rank: GPUs each rank actor reserves on a GPU cluster (0 < x <= 1; fractions let
        several groups share one GPU for testing). A GPU rank reserves no CPU.
    cpus_per_rank: logical CPUs each rank actor reserves on a CPU-only cluster (> 0). It only
        decides how many ranks a node admits: Ray gives an actor with less than one CPU one
        intra-op thread (``OMP_NUM_THREADS=max(1, floor(cpus))``), which is what a rank runs
        anyway. 0.25: the default disaggregated fleet (one prefill and one decode rank, 0.5 CPU)
        and the Serve replica (1 CPU) fit a 2-CPU machine, with room for two more ranks.
    restart: start a fresh group in the background when one dies.
    collectives_at_tp1: run the all-reduce even at tp_size 1 (a no-op on values) so one GPU can
        verify that NCCL collectives are captured inside graphs.
    num_colocated_groups: groups when mode is colocated (>= 1): data-parallel replicas, each a
        whole model (tp_size ranks) with its own KV cache, behind the fleet's router.
    num_prefill_groups, num_decode_groups: groups per role when mode is disaggregated (>= 1).
    routing: how the router picks among prefill-capable groups that can take a request now:
        "prefix_aware" (the group whose cache most likely holds the request's leading pages, within
        routing_imbalance_tokens of the least-loaded group's outstanding tokens) or
        "least_loaded" (fewest outstanding tokens). See :mod:`fleet.router`.
    routing_imbalance_tokens: how many more outstanding tokens than the least-loaded group a
        prefix-matched group may have and still be chosen (>= 0). Outstanding tokens are the ones a
        group will compute: a request's prompt less the prefix the router expects that group to have
        cached, plus its decode tokens on a colocated group.
    routing_prefix_pages: leading full prompt pages the router hashes and matches (>= 1).
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
    cpus_per_rank: float = 0.25
    restart: bool = True
    collectives_at_tp1: bool = False
    num_colocated_groups: int = 1
    num_prefill_groups: int = 1
    num_decode_groups: int = 1
    prefill_tp_size: int | None = None
    decode_tp_size: int | None = None
    kv_transport: KVTransport = "object_store"
    handoff_timeout_s: float = 60.0
    lost_after_s: float = 60.0
    max_attempts: int = 3
    routing: Routing = "prefix_aware"
    routing_imbalance_tokens: int = 8192
    routing_prefix_pages: int = 128

    def __post_init__(self) -> None:
        check_min(self.tp_size, "tp_size", 1)
        check(self.step_timeout_s > 0, "step_timeout_s", f"must be > 0, got {self.step_timeout_s!r}")
        check(self.start_timeout_s > 0, "start_timeout_s", f"must be > 0, got {self.start_timeout_s!r}")
        check(0 < self.gpus_per_rank <= 1, "gpus_per_rank", f"must be in (0, 1], got {self.gpus_per_rank!r}")
        check(self.cpus_per_rank > 0, "cpus_per_rank", f"must be > 0 (a placement group bundle cannot be empty), "
                                                       f"got {self.cpus_per_rank!r}")
        for key in ("num_colocated_groups", "num_prefill_groups", "num_decode_groups", "prefill_tp_size",
                    "decode_tp_size", "max_attempts", "routing_prefix_pages"):
            check_min(getattr(self, key), key, 1)
        check_min(self.routing_imbalance_tokens, "routing_imbalance_tokens", 0)
        for key in ("handoff_timeout_s", "lost_after_s"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)!r}")


@dataclass(frozen=True)
class GroupConfig(EngineConfig):
    """What a :class:`cluster.group.WorkerGroup` and its rank actors are configured with.

    model, attention, cache, scheduler, graphs: as :class:`worker.config.EngineConfig`.
    cluster: the topology section above.
    """

    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @classmethod
    def of(cls, config: GroupConfig) -> GroupConfig:
        """Only the sections of this class, taken from ``config`` (an instance of a subclass, such as
        deploy's ``Config``): what a group sends its rank actors, which have no use for the rest."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})
