"""Probes of the fleet tests: a fleet's worker groups by id, to inspect them or kill their ranks."""

from __future__ import annotations

from cluster.fleet_group import FleetWorkerGroup
from fleet.fleet import Fleet


def group_ids(fleet: Fleet) -> list[str]:
    """The ids of ``fleet``'s groups, prefill groups first."""
    return [s.group_id for s in fleet.members]


def fleet_group(fleet: Fleet, group_id: str) -> FleetWorkerGroup:
    """The worker group ``group_id`` of ``fleet`` (to probe it or inject faults; never drive it)."""
    for s in fleet.members:
        if s.group_id == group_id:
            return s.group
    raise KeyError(f"no group {group_id!r}; groups: {group_ids(fleet)}")
