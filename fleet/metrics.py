"""Collecting the graph metrics of every rank of a fleet, with one deadline for all of them.

Each rank keeps its own Prometheus registry (``cuda_graph_*`` with constant labels ``group``,
``rank``, ``role``, set by :meth:`cluster.rank_actor.RankActor.load`); a scrape asks every live
rank for its text at once. A rank actor runs one call at a time, so the question waits behind
the step (or the capture) the rank is running: ranks that do not answer within the deadline, and
dead ones, are left out of that scrape rather than holding it up.
"""

from __future__ import annotations

import logging

import ray
from ray.exceptions import RayError

log = logging.getLogger(__name__)


def gather_rank_metrics(groups, timeout_s: float) -> list[bytes]:
    """The ``metrics_text`` of every rank of ``groups`` that answers within ``timeout_s``, in rank order."""
    refs = [(g.group_id, a.metrics_text.remote()) for g in groups for a in g.rank_actors()]
    if not refs:
        return []
    ready, _ = ray.wait([r for _, r in refs], num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    texts: list[bytes] = []
    for group_id, ref in refs:
        if ref not in done:
            log.debug("metrics of a rank of %s: no answer within %gs", group_id, timeout_s)
            continue
        try:
            texts.append(ray.get(ref))
        except RayError as e:  # a rank died since the group listed it
            log.debug("metrics of a rank of %s: %s", group_id, type(e).__name__)
    return texts
