"""The rank actor of a fleet group: a :class:`RankActor` that also moves KV pages.

Export and import run on every rank of a group (each rank hands over its own shard of the KV
heads); see :mod:`worker.kv_pages` for the page layout.
"""

from __future__ import annotations

from cluster.rank_actor import RankActor


class FleetRankActor(RankActor):
    """A rank actor that also exports and imports a request's KV pages for the hand-off."""

    def export_pages(self, pages: list[int]):
        """This rank's KV of ``pages`` as a CPU tensor."""
        from worker import kv_pages

        return kv_pages.export_pages(self.worker, pages, to_host=True)

    def import_pages(self, pages: list[int], payload) -> int:
        """Write ``payload`` into ``pages``; returns the number of bytes written."""
        from worker import kv_pages

        kv_pages.import_pages(self.worker, pages, payload)
        return payload.numel() * payload.element_size()

    def kv_layout(self):
        """This rank's :class:`worker.kv_pages.KVLayout`."""
        from worker import kv_pages

        return kv_pages.kv_layout(self.worker)


def rank_call(handle, name: str, *args):
    """``handle.<name>.remote(*args)`` on a :class:`FleetRankActor` handle; returns the ref."""
    return getattr(handle, name).remote(*args)
