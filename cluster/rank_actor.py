"""The Ray actor hosting one tensor-parallel rank of a worker group.

The actor does no CUDA work in ``__init__``: Ray has set ``CUDA_VISIBLE_DEVICES`` for a GPU actor
by then, but the device is first touched in ``load``. The start-up methods are driven by the
driver-side group, in the same order on every rank, so collectives never interleave. After
capture, rank 0 (the leader) runs steps and rank i > 0 runs :meth:`RankActor.follow`, a call on a
thread of its own that carries out the leader's orders until the generation ends.
"""

from __future__ import annotations

import os
from datetime import timedelta

import ray

from cluster.config import GroupConfig
from cluster.rank import RankInfo
from cluster.step_channel import LeaderExecutor, StepChannel, follow
from worker.step_message import StepMessage, StepResult


class RankActor:
    """One rank: a :class:`worker.worker.Worker` on a tensor-parallel slice of the model."""

    #: ``loop``: the call that lasts a generation (a follower's :meth:`follow`), beside the default
    #: thread that answers pings, metrics and shutdown.
    concurrency_groups = {"loop": 1}

    def __init__(self, info: RankInfo, config: dict) -> None:
        self.info = info
        self.config = GroupConfig.from_dict(config)
        self.worker = None
        self.channel: StepChannel | None = None
        self.executor: LeaderExecutor | None = None
        self._store = None  # rank 0: the group's TCPStore (see rendezvous_address)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")

    def rendezvous_address(self) -> str:
        """``tcp://127.0.0.1:<port>`` of the group's store, which this rank (rank 0) opens now on a port
        the OS gives it and keeps listening on: a port picked free and bound later could be taken in
        between (another process's free port, or the API's port under direct ingress, which its
        replica binds only once it has started)."""
        from torch.distributed import TCPStore

        self._store = TCPStore("127.0.0.1", 0, self.info.world_size, is_master=True, wait_for_workers=False)
        return f"tcp://127.0.0.1:{self._store.port}"

    def init_distributed(self, init_method: str, backend: str, timeout_s: float) -> str:
        """Join the group's process group; every rank must be called concurrently."""
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
        timeout = timedelta(seconds=timeout_s)
        if self._store is not None:  # rank 0 hosts the store it opened in rendezvous_address
            self._store.set_timeout(timeout)
            # The prefix init_process_group puts on a store it makes from init_method (the other ranks').
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", self._store), rank=self.info.rank,
                                    world_size=self.info.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=self.info.rank,
                                    world_size=self.info.world_size, timeout=timeout)
        warm = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(warm)  # communicator warm-up before any capture
        if self.info.world_size > 1:
            self.channel = StepChannel(self.info.rank, self.info.world_size)
        return self.info.name

    def load(self) -> int:
        """Load this rank's weight shard; returns the KV pages this rank could hold."""
        import torch.distributed as dist

        from worker.gc_heap import watch_gc
        from worker.model.parallel import TensorParallel
        from worker.worker import Worker

        world = self.info.world_size
        collectives_at_tp1 = self.config.cluster.collectives_at_tp1
        tp = TensorParallel(self.info.rank, world, dist.group.WORLD if world > 1 or collectives_at_tp1 else None,
                            collectives_at_tp1)
        labels = {"group": self.info.group_id, "rank": str(self.info.rank), "role": self.info.role}
        self.worker = Worker(self.config, tp, metric_labels=labels)
        watch_gc(self.worker.registry, labels)
        return self.worker.available_pages()

    def max_model_len(self, num_pages: int) -> int:
        return self.worker.max_model_len(num_pages)

    def allocate(self, num_pages: int, max_model_len: int) -> None:
        self.worker.allocate(num_pages, max_model_len)

    def capture(self) -> None:
        from worker.gc_heap import freeze_startup_heap

        self.worker.capture()
        if self.info.rank == 0:
            self.executor = LeaderExecutor(self.worker, self.channel)
        freeze_startup_heap(f"rank {self.info.name}")  # this process serves one generation

    def arch(self):
        return self.worker.arch

    def execute(self, msg: StepMessage) -> StepResult:
        """Leader: hand one step to the followers and run it (a bare group's engine calls this)."""
        if self.executor is None:
            raise RuntimeError(f"{self.info.name} is not a started leader: steps go to rank 0 after capture")
        return self.executor.execute(msg)

    @ray.method(concurrency_group="loop")
    def follow(self) -> None:
        """Follower: carry out the leader's orders until it says stop (see :mod:`cluster.step_channel`)."""
        follow(self.channel, self.worker, self._stage_local, self._import_local)

    def _stage_local(self, transfer_id: str, pages: list[int]) -> None:
        raise RuntimeError(f"{self.info.name} moves no KV pages (not a fleet rank)")

    def _import_local(self, pages: list[int], transport: str, item) -> None:
        raise RuntimeError(f"{self.info.name} moves no KV pages (not a fleet rank)")

    def profile_step(self, msg: StepMessage) -> dict:
        """Run one step under the torch profiler; returns the CUDA kernel and CPU op names seen."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            self.worker.execute(msg)
            torch.cuda.synchronize()
        events = prof.events()
        cuda = sorted({e.name for e in events if e.device_type.name == "CUDA"})
        cpu = sorted({e.name for e in events if e.device_type.name == "CPU"})
        return {"cuda": cuda, "cpu": cpu}

    def collective_counts(self) -> dict:
        """Collective calls so far: ``captured`` (recorded into graphs) and ``eager``."""
        counts = self.worker.model.tp.counts
        return {"captured": counts.captured, "eager": counts.eager}

    def metrics_text(self) -> bytes:
        """This rank's registry in the Prometheus text format (empty before :meth:`load`)."""
        from prometheus_client import generate_latest

        return generate_latest(self.worker.registry) if self.worker is not None else b""

    def ping(self) -> str:
        return self.info.name

    def shutdown(self) -> None:
        """Leader: stop the followers first. Graphs, then the process group (graphs may have recorded
        its collectives)."""
        import torch.distributed as dist

        if self.executor is not None:
            executor, self.executor = self.executor, None
            executor.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

