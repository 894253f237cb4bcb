"""KV hand-off transports: how a prefill group's KV pages reach a decode group.

One interface, :class:`KVTransport`: ``export`` starts copying a request's pages out of every rank
of the prefill group and returns a :class:`KVPayload` at once; ``import_`` writes the payload into
pages of a decode group (rank ``i`` receives rank ``i``'s shard) and blocks until every rank has.

Ordering invariant (what makes freeing the prefill pages right after ``export`` safe): the export
is submitted to each rank before that rank's next step, and Ray runs one caller's tasks on an
actor in submission order, so the copy is taken before any later step can overwrite the pages.
A transport whose export is asynchronous on the device must keep the same guarantee (e.g. record
the copy on the step stream). The same order protects a timed-out import: its late writes land
before those of any later owner of the pages.

Transports: ``object_store`` (each prefill rank returns its pages as a CPU tensor, Ray keeps it in
the object store, each decode rank receives it by ``ObjectRef``; the CPU default, also correct on
GPU at host-copy speed). GPU transports (``nccl``: NCCL point-to-point between rank ``i`` of the two
groups, ``cuda_ipc``: same-node device-memory handles) are not built: asking for one raises
:class:`KVTransportUnavailable`. One would subclass :class:`KVTransport`, keep shards on the device
in ``export``, receive them in ``import_``, and register itself in ``TRANSPORTS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import ray
from ray.exceptions import GetTimeoutError, RayError

from cluster.fleet_rank import rank_call


class KVTransportUnavailable(RuntimeError):
    """The configured KV transport is not built into this graphfleet."""


class KVTransferFailed(RuntimeError):
    """A hand-off did not complete (a rank died, the export failed, or it timed out)."""


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
    """Moves KV pages between ranks of two groups with equal tp sizes."""

    name: ClassVar[str]

    @abstractmethod
    def export(self, group, pages: list[int], num_tokens: int) -> KVPayload:
        """Start exporting ``pages`` from every rank of ``group`` without waiting for the ranks."""

    @abstractmethod
    def import_(self, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        """Write ``payload`` into ``pages`` on every rank of ``group``; returns bytes moved.

        Raises :class:`KVTransferFailed` naming the groups and the cause.
        """


class ObjectStoreTransport(KVTransport):
    """Through Ray's object store: prefill ranks return CPU tensors, decode ranks get them by reference."""

    name = "object_store"

    def export(self, group, pages: list[int], num_tokens: int) -> KVPayload:
        actors = group.rank_actors()
        if len(actors) != group.tp_size:
            raise KVTransferFailed(f"group {group.group_id} is {group.state.value}: cannot export KV")
        shards = tuple(rank_call(a, "export_pages", list(pages)) for a in actors)
        return KVPayload(self.name, group.group_id, shards, len(pages), num_tokens)

    def import_(self, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        where = f"KV hand-off {payload.source_group} -> {group.group_id}"
        if payload.transport != self.name:
            raise KVTransferFailed(f"{where}: payload came from transport {payload.transport!r}, not {self.name!r}")
        if len(pages) != payload.num_pages:
            raise KVTransferFailed(f"{where}: {payload.num_pages} pages exported, {len(pages)} allocated")
        actors = group.rank_actors()
        if len(actors) != len(payload.shards):
            raise KVTransferFailed(f"{where}: {len(payload.shards)} shards for {len(actors)} live ranks "
                                   f"(group {group.group_id} is {group.state.value})")
        refs = [rank_call(a, "import_pages", list(pages), s) for a, s in zip(actors, payload.shards)]
        try:
            return sum(ray.get(refs, timeout=timeout_s))
        except GetTimeoutError:
            raise KVTransferFailed(f"{where}: not done after {timeout_s:g}s") from None
        except RayError as e:
            raise KVTransferFailed(f"{where} failed: {describe_ray_error(e)}") from None


def describe_ray_error(e: BaseException) -> str:
    """``Type: first line`` of the underlying error (a task error's cause, not Ray's wrapper)."""
    for _ in range(4):  # a failed dependency wraps the failure of the task that produced it
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException) or cause is e:
            break
        e = cause
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


TRANSPORTS: dict[str, type[KVTransport]] = {ObjectStoreTransport.name: ObjectStoreTransport}
NOT_BUILT = ("nccl", "cuda_ipc")


def create_transport(name: str) -> KVTransport:
    """The transport called ``name``; raises :class:`KVTransportUnavailable` for any other."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]()
    built = ", ".join(sorted(TRANSPORTS))
    if name in NOT_BUILT:
        raise KVTransportUnavailable(
            f"kv_transport={name!r} is not available: this build has only {built}. A GPU transport "
            "(NCCL point-to-point / CUDA IPC) plugs in as a KVTransport subclass in cluster/kv_transport.py")
    raise KVTransportUnavailable(f"unknown kv_transport {name!r}; available: {built} "
                                 f"(planned, not built: {', '.join(NOT_BUILT)})")
