"""KV hand-off transports: how a prefill group's KV pages reach a decode group.

One interface, :class:`KVTransport`: ``export_kv`` starts copying a request's pages out of every rank
of the prefill group and returns a :class:`KVPayload` at once; ``import_kv`` writes the payload into
pages of a decode group (rank ``i`` receives rank ``i``'s shard) and blocks until every rank has.

Ordering invariant (what makes freeing the prefill pages right after ``export_kv`` safe): ``export_kv``
returns only once every rank has finished a device copy of the pages (``stage_pages``), so any
later step's writes come after the copy; task order alone would not do, because compiled-graph
steps run on another thread (and perhaps stream) of the rank than its Ray tasks. A timed-out
import could still write after the decode group reuses the pages: the fleet fails that group
(``KVTransferFailed.timed_out``), as for a step timeout.

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
    """A hand-off did not complete (a rank died, the export failed, or it timed out).

    ``timed_out``: the import may still be writing into the decode group's pages.
    """

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


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

    stage_timeout_s: float = 60.0

    @abstractmethod
    def export_kv(self, group, pages: list[int], num_tokens: int) -> KVPayload:
        """Export ``pages`` from every rank of ``group``: returns once each rank holds a device copy."""

    def check(self, prefill_groups: list, decode_groups: list, timeout_s: float) -> None:
        """Raise :class:`KVTransportUnavailable` if this transport cannot connect these groups."""
        return None

    def _stage(self, group, pages: list[int]) -> tuple[list, str]:
        """Every rank of ``group`` copies ``pages`` on its device; returns (rank actors, transfer id)."""
        actors = group.rank_actors()
        if len(actors) != group.tp_size:
            raise KVTransferFailed(f"group {group.group_id} is {group.state.value}: cannot export KV")
        transfer_id = uuid.uuid4().hex
        staged = [a.stage_pages.remote(transfer_id, list(pages)) for a in actors]
        try:
            ray.get(staged, timeout=self.stage_timeout_s)
        except (GetTimeoutError, RayError) as e:
            _drop_staged(actors, transfer_id)
            raise KVTransferFailed(f"KV export from {group.group_id} failed: {describe_ray_error(e)}") from None
        return actors, transfer_id

    def _targets(self, group, pages: list[int], payload: KVPayload) -> tuple[str, list]:
        """(a description of the hand-off, the live ranks of ``group``) once ``payload`` fits them."""
        where = f"KV hand-off {payload.source_group} -> {group.group_id}"
        if payload.transport != self.name:
            raise KVTransferFailed(f"{where}: payload came from transport {payload.transport!r}, not {self.name!r}")
        if len(pages) != payload.num_pages:
            raise KVTransferFailed(f"{where}: {payload.num_pages} pages exported, {len(pages)} allocated")
        actors = group.rank_actors()
        if len(actors) != len(payload.shards):
            raise KVTransferFailed(f"{where}: {len(payload.shards)} shards for {len(actors)} live ranks "
                                   f"(group {group.group_id} is {group.state.value})")
        return where, actors

    def _import(self, method: str, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        where, actors = self._targets(group, pages, payload)
        return sum(_transfer([getattr(a, method).remote(list(pages), s) for a, s in zip(actors, payload.shards)],
                             timeout_s, where))

    @abstractmethod
    def import_kv(self, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        """Write ``payload`` into ``pages`` on every rank of ``group``; returns bytes moved.

        Raises :class:`KVTransferFailed` naming the groups and the cause.
        """


class ObjectStoreTransport(KVTransport):
    """Through Ray's object store: prefill ranks return CPU tensors, decode ranks get them by reference."""

    name = "object_store"

    def export_kv(self, group, pages: list[int], num_tokens: int) -> KVPayload:
        actors, transfer_id = self._stage(group, pages)
        shards = tuple(a.take_staged.remote(transfer_id) for a in actors)
        return KVPayload(self.name, group.group_id, shards, len(pages), num_tokens)

    def import_kv(self, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        return self._import("import_pages", group, pages, payload, timeout_s)


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

    def export_kv(self, group, pages: list[int], num_tokens: int) -> KVPayload:
        actors, transfer_id = self._stage(group, pages)
        shards = tuple(a.share_staged.remote(transfer_id) for a in actors)
        payload = KVPayload(self.name, group.group_id, shards, len(pages), num_tokens)
        weakref.finalize(payload, _drop_staged, actors, transfer_id)  # the senders keep the copies until then
        return payload

    def import_kv(self, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        return self._import("import_shared", group, pages, payload, timeout_s)


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

    def export_kv(self, group, pages: list[int], num_tokens: int) -> KVPayload:
        actors, transfer_id = self._stage(group, pages)
        payload = KVPayload(self.name, group.group_id, tuple((a, transfer_id) for a in actors), len(pages),
                            num_tokens)
        weakref.finalize(payload, _drop_staged, actors, transfer_id)
        return payload

    def import_kv(self, group, pages: list[int], payload: KVPayload, timeout_s: float) -> int:
        where, actors = self._targets(group, pages, payload)
        pairs = [(src, dst, self._pair(src, dst, timeout_s, where)) for (src, _), dst in zip(payload.shards, actors)]
        refs = []
        for (src, transfer_id), (_, dst, pair_id) in zip(payload.shards, pairs):
            refs += [src.p2p_send.remote(pair_id, transfer_id), dst.p2p_recv.remote(pair_id, list(pages))]
        try:
            return sum(_transfer(refs, timeout_s, where)) // 2  # each byte is counted by its sender and receiver
        except KVTransferFailed:
            for src, dst, pair_id in pairs:  # a failed transfer leaves the pair unusable: rebuild it next time
                self._pairs.pop((src._actor_id.hex(), dst._actor_id.hex()), None)
                for a in (src, dst):
                    a.p2p_close.remote(pair_id)
            raise

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


def _device_uuids(group, timeout_s: float) -> list[str | None]:
    """Each rank's GPU UUID, in rank order (None for a CPU rank)."""
    return ray.get([a.device_uuid.remote() for a in group.rank_actors()], timeout=timeout_s)


def _transfer(refs: list, timeout_s: float, where: str) -> list:
    """The results of a hand-off's rank tasks, failing as soon as one fails, as
    :class:`KVTransferFailed` (``timed_out`` when the tasks may still be writing)."""
    try:
        return _get_failing_fast(refs, timeout_s)
    except GetTimeoutError:
        raise KVTransferFailed(f"{where}: not done after {timeout_s:g}s", timed_out=True) from None
    except RayError as e:
        raise KVTransferFailed(f"{where} failed: {describe_ray_error(e)}") from None


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
