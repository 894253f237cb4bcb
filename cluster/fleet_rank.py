"""The rank actor of a fleet group: a :class:`RankActor` that hosts its group's engine (rank 0)
and moves KV pages.

The leader's engine loop (:mod:`cluster.engine_host`) runs on the ``loop`` thread; the fleet's
command batches arrive as Ray calls on a thread of their own (``engine_in``), and the loop's reports
leave over the generation's report link (:mod:`cluster.report_link`), not through Ray.
Staging and importing KV run on every rank in the order of the leader's steps (each rank hands
over its own shard of the KV heads; see :mod:`worker.kv_pages` for the page layout); the staged
copies then leave through Ray calls on the default thread.
"""

from __future__ import annotations

import math
import threading
import time
import warnings

import numpy as np
import ray
import torch

from cluster.engine_host import EngineHost
from cluster.kv_transport import resolve_shards
from cluster.rank_actor import RankActor
from cluster.report_link import LinkAddress, ReportServer
from worker.gc_heap import freeze_startup_heap

#: How long a call for a staged copy waits for the rank's loop to have made it.
STAGED_WAIT_S = 60.0


class FleetRankActor(RankActor):
    """A rank actor that hosts its group's engine (the leader) and exports and imports a request's
    KV pages for the hand-off.

    Export: the leader's engine stages the pages on every rank (its own copy, and an order to each
    follower) before anything can reuse them; the fleet then takes the copies (``take_staged``,
    ``share_staged``, ``p2p_send``), which wait until this rank's loop has made its copy.
    """

    #: ``engine_in``: the fleet's command batches (one thread, so batches arrive in order). Point-to-point opens,
    #: sends and receives run on threads of their own: one blocked on a dead peer (until its pair's
    #: timeout) must not hold up staging, imports, shutdown, or the transfers of newer pairs.
    concurrency_groups = {"loop": 1, "engine_in": 1, "kv_p2p": 4}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._staged: dict[str, object] = {}
        self._staged_cond = threading.Condition()
        self._pairs: dict[str, tuple] = {}  # pair id -> (process group, store, peer rank)
        self._pair_stores: dict[int, object] = {}  # port -> a pair's store opened by pair_address, not yet joined
        self.host: EngineHost | None = None
        self.reports: ReportServer | None = None

    # ----- the group's engine (leader) -----

    def start_engine(self, max_model_len: int) -> LinkAddress:
        """Build this generation's engine (after capture), stopping sequences at ``max_model_len``;
        returns where its reports can be read (one client, see :mod:`cluster.report_link`)."""
        self.host = host = EngineHost(self.config, self.executor, self.info.role, max_model_len, self._stage_local,
                                      resolve_shards, self._import_local)
        self.reports = ReportServer(ray.util.get_node_ip_address(), host.take_report, lambda: host.stopping)
        self.reports.start()
        freeze_startup_heap(f"group leader {self.info.name}")
        return self.reports.address

    @ray.method(concurrency_group="loop")
    def serve_engine(self) -> None:
        """Run the engine loop until shutdown; raises when a step fails (the group is dead)."""
        self.host.run()

    @ray.method(concurrency_group="engine_in")
    def engine_commands(self, number: int, commands: list) -> None:
        self.host.put(number, commands)

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.stop()
            deadline = time.monotonic() + 5.0
            while self.host.running and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.host.running:  # stuck in a step: its thread may still use the channel, so no stop order
                self.executor = None
        if self.reports is not None:
            self.reports.close()
        super().shutdown()

    # ----- KV pages -----

    def _stage_local(self, transfer_id: str, pages: list[int]) -> None:
        """Copy ``pages``' KV (on the device) for a later take (runs in the rank's step order)."""
        from worker import kv_pages

        out = kv_pages.export_pages(self.worker, pages)
        if out.is_cuda:
            # The copy must be done, not just enqueued, before a later step reuses the pages or
            # another thread (stream) reads it.
            torch.cuda.current_stream(out.device).synchronize()
        with self._staged_cond:
            self._staged[transfer_id] = out
            self._staged_cond.notify_all()

    def _wait_staged(self, transfer_id: str, take: bool = False):
        """The staged copy ``transfer_id`` once this rank's loop has made it (removed here with ``take``)."""
        with self._staged_cond:
            if not self._staged_cond.wait_for(lambda: transfer_id in self._staged, STAGED_WAIT_S):
                raise RuntimeError(f"{self.info.name}: KV copy {transfer_id} not staged after {STAGED_WAIT_S:g}s")
            return self._staged.pop(transfer_id) if take else self._staged[transfer_id]

    def take_staged(self, transfer_id: str):
        """The staged copy as the raw bytes of a CPU tensor (a uint8 numpy array: Ray stores numpy
        arrays without a copy and readers map them; a torch tensor is pickled, ~3x slower)."""
        return self._wait_staged(transfer_id, take=True).cpu().reshape(-1).view(torch.uint8).numpy()

    def drop_staged(self, transfer_id: str) -> None:
        with self._staged_cond:
            self._staged.pop(transfer_id, None)

    def _import_local(self, pages: list[int], transport: str, item) -> None:
        """Write this rank's shard of an imported request's KV into ``pages`` (in step order)."""
        if transport == "cuda_ipc":
            self._import_shared(pages, item)
        elif transport == "nccl":
            self._p2p_recv(item, pages)
        else:
            self._import_pages(pages, item)

    def device_uuid(self) -> str | None:
        """The UUID of this rank's GPU (None on CPU): CUDA IPC needs both sides on one device."""
        import torch

        if self.worker.device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(self.worker.device).uuid)

    def share_staged(self, transfer_id: str) -> tuple:
        """A CUDA IPC handle of the staged copy, ``(gpu uuid, rebuild, args)``; the copy stays here
        until :meth:`drop_staged` (the receiver maps this actor's memory)."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        staged = self._wait_staged(transfer_id)
        if staged.device.type != "cuda":
            raise RuntimeError("cuda_ipc moves device memory: this rank's KV cache is on the CPU")
        torch.cuda.current_stream(staged.device).synchronize()  # the copy is complete before anyone maps it
        rebuild, args = reduce_tensor(staged)
        return self.device_uuid(), rebuild, args

    def _import_shared(self, pages: list[int], shard: tuple) -> int:
        """Map a :meth:`share_staged` handle of the matching prefill rank and copy it into ``pages``."""
        import torch

        from worker import kv_pages

        uuid, rebuild, args = shard
        if uuid != self.device_uuid():
            raise RuntimeError(f"cuda_ipc: the KV was staged on GPU {uuid}, this rank runs on {self.device_uuid()} "
                               "(CUDA IPC needs both groups on one GPU; use kv_transport=object_store)")
        payload = rebuild(*args)
        kv_pages.import_pages(self.worker, pages, payload)
        torch.cuda.current_stream(self.worker.device).synchronize()  # done reading before the sender frees it
        return payload.numel() * payload.element_size()

    def _import_pages(self, pages: list[int], payload) -> int:
        """Write ``payload`` (a :meth:`take_staged` byte array, or a tensor) into ``pages``;
        returns the number of bytes written."""
        from worker import kv_pages

        if isinstance(payload, np.ndarray):
            payload = _tensor_from_bytes(payload, self.worker.kv_cache.dtype,
                                         kv_pages.kv_layout(self.worker).payload_shape(len(pages)))
        kv_pages.import_pages(self.worker, pages, payload)
        if self.worker.device.type == "cuda":
            torch.cuda.current_stream(self.worker.device).synchronize()  # written before the next step reads
        return payload.numel() * payload.element_size()

    def kv_layout(self):
        """This rank's :class:`worker.kv_pages.KVLayout`."""
        from worker import kv_pages

        return kv_pages.kv_layout(self.worker)


    # ----- point-to-point pairs (kv_transport=nccl) -----

    def pair_address(self) -> tuple[str, int]:
        """This node's address and the port of a pair's store, which this rank hosts: opened now on a
        port the OS gives it and kept listening until :meth:`p2p_open` takes it (a port picked free
        and bound later could be taken in between)."""
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, 2, is_master=True, wait_for_workers=False)
        self._pair_stores[store.port] = store
        return host, store.port

    @ray.method(concurrency_group="kv_p2p")
    def p2p_open(self, pair_id: str, host: str, port: int, rank: int, timeout_s: float) -> str:
        """Join the two-process group ``pair_id`` (rank 0: the prefill rank, which hosts the store).

        NCCL between GPU ranks, gloo between CPU ranks; both sides must call at once.
        """
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        if rank == 0:  # the store pair_address opened
            base = self._pair_stores.pop(port)
            base.set_timeout(timeout)
        else:
            base = dist.TCPStore(host, port, 2, is_master=False, timeout=timeout)
        store = dist.PrefixStore(pair_id, base)
        if self.worker.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, 2, opts)
            backend = "nccl"
        else:
            group, backend = dist.ProcessGroupGloo(store, rank, 2, timeout), "gloo"
        self._pairs[pair_id] = (group, store, 1 - rank)
        return backend

    @ray.method(concurrency_group="kv_p2p")
    def p2p_send(self, pair_id: str, transfer_id: str) -> int:
        """Send the staged copy ``transfer_id`` to the pair's other rank (it is dropped here after)."""
        import torch

        staged = self._wait_staged(transfer_id, take=True)
        group, _, peer = self._pairs[pair_id]
        group.send([staged], peer, 0).wait()
        if staged.is_cuda:
            torch.cuda.current_stream(staged.device).synchronize()
        return staged.numel() * staged.element_size()

    def _p2p_recv(self, pair_id: str, pages: list[int]) -> int:
        """Receive a request's KV from the pair's other rank into ``pages`` (on the loop thread, in step
        order)."""
        import torch

        from worker import kv_pages

        layout = kv_pages.kv_layout(self.worker)
        cache = self.worker.kv_cache
        buf = torch.empty(layout.payload_shape(len(pages)), dtype=cache.dtype, device=cache.device)
        group, _, peer = self._pairs[pair_id]
        group.recv([buf], peer, 0).wait()
        kv_pages.import_pages(self.worker, pages, buf)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        return buf.numel() * buf.element_size()

    def p2p_close(self, pair_id: str) -> None:
        self._pairs.pop(pair_id, None)


def _tensor_from_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data``'s bytes (read-only: it is only read, into the cache)."""
    want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if data.dtype != np.uint8 or data.size != want:
        raise ValueError(f"KV payload of {data.size} bytes ({data.dtype}) does not fit {shape} {dtype} ({want} bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": a read-only object-store buffer
        return torch.from_numpy(data).view(dtype).reshape(shape)
