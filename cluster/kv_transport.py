"""KV hand-off transports: how a prefill group's KV pages reach a decode group.

Export: the prefill group's leader stages a request's pages on every rank as the request's first
token is sampled (its own copy at once, an order to each follower, which runs it before any
later step: :mod:`cluster.step_channel`), so freeing the pages right after is safe. The fleet
wraps what was staged in a :class:`KVPayload` (:meth:`KVTransport.payload`). Import: the fleet
sends the payload's shards (:meth:`KVTransport.shards_for`) with the request to a decode group's
leader, which resolves them (:func:`resolve_shards`), allocates pages and has every rank write
its shard, in step order, before the request's first decode step. A failed import that may still
write (a timeout, or followers told to import) fails the decode group.

Transports: ``object_store`` (each prefill rank returns its pages as a CPU tensor, Ray keeps it in
the object store, each decode rank receives it by ``ObjectRef``; the CPU default, also correct on
GPU at host-copy speed) and ``cuda_ipc`` (groups sharing one GPU: the staged device copy stays in
the prefill rank, the decode rank maps it by CUDA IPC handle and copies device to device; the
copy is dropped when the payload is) and ``nccl`` (groups on different GPUs: rank ``i`` of the
prefill group sends its staged copy to rank ``i`` of the decode group over a two-process group,
NCCL between GPU ranks; between CPU ranks the same protocol runs over gloo, which is how CI
covers it). A pair is opened on first use and rebuilt when either side restarts or a transfer
fails.
"""

from __future__ import annotations

import time
import uuid
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import ray
from ray.exceptions import GetTimeoutError, RayError


class KVTransportUnavailable(RuntimeError):
    """The configured KV transport is not built into this graphfleet."""


class KVTransferFailed(RuntimeError):
    """A hand-off did not complete (a rank died, the export failed, or it timed out). Whether the
    import may still write into the decode group's pages is the decode leader's call
    (:class:`cluster.group_messages.Refused`'s ``fail_group``)."""


@dataclass(frozen=True)
class KVPayload:
    """One request's exported KV: a shard per rank of ``source_group``, in rank order.

    ``num_tokens`` tokens of KV live in ``num_pages`` pages; the shards are the transport's
    handles (``ObjectRef`` for ``object_store``). Dropping the payload releases them.
    """

    transport: str
    source_group: str
    shards: tuple
    num_pages: int
    num_tokens: int


class KVTransport(ABC):
    """Moves KV pages between ranks of two groups with equal tp sizes.

    The fleet's side: :meth:`payload` wraps what a prefill group's leader staged on its ranks,
    :meth:`shards_for` turns a payload into what a decode group's leader needs to import it
    (:func:`resolve_shards` on that side), :meth:`transfer_failed` cleans up after a failed one.
    """

    name: ClassVar[str]

    def check(self, prefill_groups: list, decode_groups: list, timeout_s: float) -> None:
        """Raise :class:`KVTransportUnavailable` if this transport cannot connect these groups."""
        return None

    @abstractmethod
    def payload(self, group, transfer_id: str, num_pages: int, num_tokens: int) -> KVPayload:
        """The payload of KV staged under ``transfer_id`` on every rank of ``group``."""

    def shards_for(self, payload: KVPayload, group, timeout_s: float) -> tuple:
        """What the ranks of decode group ``group`` import ``payload`` from (one item per rank)."""
        self._check_fits(payload, group)
        return payload.shards

    def transfer_failed(self, payload: KVPayload, group, shards: tuple) -> None:
        """A transfer of ``payload`` into ``group`` failed: clean up what it left (nothing, here)."""
        return None

    def _check_fits(self, payload: KVPayload, group) -> None:
        where = f"KV hand-off {payload.source_group} -> {group.group_id}"
        if payload.transport != self.name:
            raise KVTransferFailed(f"{where}: payload came from transport {payload.transport!r}, not {self.name!r}")
        actors = group.rank_actors()
        if len(actors) != len(payload.shards):
            raise KVTransferFailed(f"{where}: {len(payload.shards)} shards for {len(actors)} live ranks "
                                   f"(group {group.group_id} is {group.state.value})")

    @staticmethod
    def _sources(group) -> list:
        actors = group.rank_actors()
        if len(actors) != group.tp_size:
            raise KVTransferFailed(f"group {group.group_id} is {group.state.value}: cannot export KV")
        return actors


class ObjectStoreTransport(KVTransport):
    """Through Ray's object store: prefill ranks return CPU tensors, decode ranks get them by reference."""

    name = "object_store"

    def payload(self, group, transfer_id: str, num_pages: int, num_tokens: int) -> KVPayload:
        # The fleet owns the references: the bytes outlive the prefill rank that made them.
        shards = tuple(a.take_staged.remote(transfer_id) for a in self._sources(group))
        return KVPayload(self.name, group.group_id, shards, num_pages, num_tokens)


class CudaIpcTransport(KVTransport):
    """Groups sharing one GPU: decode ranks map the prefill ranks' staged copies by CUDA IPC."""

    name = "cuda_ipc"

    def check(self, prefill_groups: list, decode_groups: list, timeout_s: float) -> None:
        decode = {g.group_id: _device_uuids(g, timeout_s) for g in decode_groups}
        for p in prefill_groups:
            mine = _device_uuids(p, timeout_s)
            if None in mine:
                raise KVTransportUnavailable("kv_transport=cuda_ipc moves device memory, but the ranks run on "
                                             "the CPU; use kv_transport=object_store")
            for gid, theirs in decode.items():
                if theirs != mine:
                    raise KVTransportUnavailable(
                        f"kv_transport=cuda_ipc needs rank i of every prefill and decode group on one GPU: "
                        f"{p.group_id} is on {mine}, {gid} on {theirs}; use kv_transport=object_store")

    def payload(self, group, transfer_id: str, num_pages: int, num_tokens: int) -> KVPayload:
        actors = self._sources(group)
        shards = tuple(a.share_staged.remote(transfer_id) for a in actors)
        payload = KVPayload(self.name, group.group_id, shards, num_pages, num_tokens)
        weakref.finalize(payload, _drop_staged, actors, transfer_id)  # the senders keep the copies until then
        return payload


class NcclTransport(KVTransport):
    """Point-to-point between matching ranks: NCCL between GPU ranks (gloo between CPU ranks)."""

    name = "nccl"

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], str] = {}  # (prefill actor, decode actor) -> pair id

    def check(self, prefill_groups: list, decode_groups: list, timeout_s: float) -> None:
        decode = {g.group_id: _device_uuids(g, timeout_s) for g in decode_groups}
        for p in prefill_groups:
            mine = _device_uuids(p, timeout_s)
            for gid, theirs in decode.items():
                if (None in mine) != (None in theirs):
                    raise KVTransportUnavailable(f"kv_transport=nccl: {p.group_id} and {gid} are not both on GPUs "
                                                 "or both on CPUs")
                shared = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a is not None and a == b]
                if shared:
                    raise KVTransportUnavailable(
                        f"kv_transport=nccl: rank {shared[0]} of {p.group_id} and of {gid} share one GPU, and NCCL "
                        "cannot pair two ranks on one device; use kv_transport=cuda_ipc")

    def payload(self, group, transfer_id: str, num_pages: int, num_tokens: int) -> KVPayload:
        actors = self._sources(group)
        payload = KVPayload(self.name, group.group_id, tuple((a, transfer_id) for a in actors), num_pages,
                            num_tokens)
        weakref.finalize(payload, _drop_staged, actors, transfer_id)
        return payload

    def shards_for(self, payload: KVPayload, group, timeout_s: float) -> tuple:
        """(prefill rank, transfer id, pair id) per rank; opens the pairs it has not opened yet."""
        self._check_fits(payload, group)
        where = f"KV hand-off {payload.source_group} -> {group.group_id}"
        return tuple((src, transfer_id, self._pair(src, dst, timeout_s, where))
                     for (src, transfer_id), dst in zip(payload.shards, group.rank_actors()))

    def transfer_failed(self, payload: KVPayload, group, shards: tuple) -> None:
        """A failed transfer leaves its pairs unusable: they are rebuilt next time."""
        for (src, _, pair_id), dst in zip(shards, group.rank_actors()):
            self._pairs.pop((src._actor_id.hex(), dst._actor_id.hex()), None)
            for a in (src, dst):
                a.p2p_close.remote(pair_id)

    def _pair(self, src, dst, timeout_s: float, where: str) -> str:
        key = (src._actor_id.hex(), dst._actor_id.hex())
        if key in self._pairs:
            return self._pairs[key]
        pair_id = f"kv-{uuid.uuid4().hex[:12]}"
        try:
            host, port = ray.get(src.pair_address.remote(), timeout=timeout_s)
            _get_failing_fast([src.p2p_open.remote(pair_id, host, port, 0, timeout_s),
                               dst.p2p_open.remote(pair_id, host, port, 1, timeout_s)], timeout_s)
        except (GetTimeoutError, RayError) as e:
            for a in (src, dst):
                a.p2p_close.remote(pair_id)
            raise KVTransferFailed(f"{where}: opening the point-to-point pair failed: {describe_ray_error(e)}") \
                from None
        self._pairs[key] = pair_id
        return pair_id


def resolve_shards(transport: str, shards: tuple, timeout_s: float) -> list:
    """Decode leader: one item per rank to import from (see :meth:`KVTransport.shards_for`).

    ``object_store``: each rank's bytes; ``cuda_ipc``: each rank's IPC handle; ``nccl``: each
    rank's pair id, once the prefill ranks have been told to send (their sends meet the ranks'
    receives, which run in step order).
    """
    if transport == "nccl":
        for src, transfer_id, pair_id in shards:
            src.p2p_send.remote(pair_id, transfer_id)
        return [pair_id for _, _, pair_id in shards]
    try:
        return ray.get(list(shards), timeout=timeout_s)
    except GetTimeoutError:
        raise KVTransferFailed(f"KV shards not available after {timeout_s:g}s") from None
    except RayError as e:
        raise KVTransferFailed(f"KV shards lost: {describe_ray_error(e)}") from None


def _device_uuids(group, timeout_s: float) -> list[str | None]:
    """Each rank's GPU UUID, in rank order (None for a CPU rank)."""
    return ray.get([a.device_uuid.remote() for a in group.rank_actors()], timeout=timeout_s)


def _get_failing_fast(refs: list, timeout_s: float) -> list:
    """``ray.get(refs)``, but the first failure raises at once: when one side of a transfer dies,
    the other waits on it until the pair's timeout, and so would a plain ``ray.get``."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GetTimeoutError(f"{len(pending)} of {len(refs)} transfer tasks not done after {timeout_s:g}s")
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            ray.get(ref)  # raises the task's error
    return ray.get(refs)


def _drop_staged(actors: list, transfer_id: str) -> None:
    for a in actors:
        try:
            a.drop_staged.remote(transfer_id)
        except Exception:  # noqa: BLE001 - a dead rank has dropped everything already
            pass


def describe_ray_error(e: BaseException) -> str:
    """``Type: first line`` of the underlying error (a task error's cause, not Ray's wrapper)."""
    for _ in range(4):  # a failed dependency wraps the failure of the task that produced it
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException) or cause is e:
            break
        e = cause
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


TRANSPORTS: dict[str, type[KVTransport]] = {t.name: t for t in (ObjectStoreTransport, CudaIpcTransport,
                                                                  NcclTransport)}


def create_transport(name: str) -> KVTransport:
    """The transport called ``name``; raises :class:`KVTransportUnavailable` for any other."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]()
    raise KVTransportUnavailable(f"unknown kv_transport {name!r}; available: {', '.join(sorted(TRANSPORTS))}")
