"""Per-rank KV hand-off methods: the rank actor of a fleet group, and how the driver calls them.

``FleetRankActor`` is a :class:`cluster.rank_actor.RankActor` that can also export and import a
request's KV pages (:mod:`worker.kv_pages`). :func:`rank_call` invokes one of these methods on a
rank actor handle; on a plain ``RankActor`` (a ``WorkerGroup`` that cannot yet be told which actor
class to start) it runs the same function on the actor through Ray's ``__ray_call__``, so the
rank-side code is the same either way.
"""

from __future__ import annotations

from cluster.rank_actor import RankActor


def export_pages(actor: RankActor, pages: list[int]):
    """The rank's KV of ``pages`` as a CPU tensor (see :func:`worker.kv_pages.export_pages`)."""
    from worker import kv_pages

    return kv_pages.export_pages(actor.worker, pages, to_host=True)


def import_pages(actor: RankActor, pages: list[int], payload) -> int:
    """Write ``payload`` into ``pages``; returns the number of bytes written."""
    from worker import kv_pages

    kv_pages.import_pages(actor.worker, pages, payload)
    return payload.numel() * payload.element_size()


def kv_layout(actor: RankActor):
    """The rank's :class:`worker.kv_pages.KVLayout`."""
    from worker import kv_pages

    return kv_pages.kv_layout(actor.worker)


_FUNCTIONS = {f.__name__: f for f in (export_pages, import_pages, kv_layout)}


class FleetRankActor(RankActor):
    """A rank actor that also moves KV pages for the fleet's prefill -> decode hand-off."""

    def export_pages(self, pages: list[int]):
        return export_pages(self, pages)

    def import_pages(self, pages: list[int], payload) -> int:
        return import_pages(self, pages, payload)

    def kv_layout(self):
        return kv_layout(self)


def rank_call(handle, name: str, *args):
    """``handle.<name>.remote(*args)`` for one of this module's per-rank functions; returns the ref."""
    method = getattr(handle, name, None)
    if method is not None:
        return method.remote(*args)
    return handle.__ray_call__.remote(_FUNCTIONS[name], *args)
