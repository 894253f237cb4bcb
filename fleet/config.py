"""A fleet's settings: its own (:class:`FleetConfig`) and how the config's ``cluster`` section lays out its groups.

Everything that is a config key stays in the config (:class:`cluster.config.GroupConfig`): the group layout per role,
the hand-off and failure bounds (``cluster.*``) and the admission queue
(``scheduler.max_waiting_requests``). :func:`apply_fleet_options` turns ``Fleet.start``'s keyword
options into a :class:`FleetConfig` and overrides of those sections, validated under their key path.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from cluster.config import ClusterConfig, GroupConfig
from configkit import ConfigError

Role = Literal["colocated", "prefill", "decode"]

_PHASES = {"colocated": ("prefill", "decode"), "prefill": ("prefill",), "decode": ("decode",)}

#: Fleet.start options that override a key of a config section other than ``cluster``.
_SECTION_OPTIONS = {"max_waiting_requests": "scheduler"}


@dataclass(frozen=True)
class FleetConfig:
    """The settings of a :class:`fleet.fleet.Fleet` that are no config key.

    name: prefix of the group ids (Ray actor names must be unique); None = a random one.
    idle_poll_s: how long the loop waits for work when there is none (> 0).
    """

    name: str | None = None
    idle_poll_s: float = 0.02

    def __post_init__(self) -> None:
        if not self.idle_poll_s > 0:
            raise ConfigError(f"fleet option idle_poll_s must be > 0, got {self.idle_poll_s!r}")
        if self.name is None:
            object.__setattr__(self, "name", f"fleet-{uuid.uuid4().hex[:6]}")


def apply_fleet_options(config: GroupConfig, **options: Any) -> tuple[GroupConfig, FleetConfig]:
    """``config`` with ``Fleet.start``'s keyword ``options`` applied, and the fleet's own settings.

    An option is a :class:`FleetConfig` field, a key of the ``cluster`` section (``mode``,
    ``num_decode_groups``, ``prefill_tp_size``, ``kv_transport``, ...) or ``max_waiting_requests``
    (``scheduler``). Section keys are validated as the YAML's are, under their key path. Raises
    :class:`ConfigError` for an unknown option, a bad value, or a disaggregated layout whose prefill
    and decode tp sizes differ.
    """
    own = {f.name for f in dataclasses.fields(FleetConfig)}
    sections = {f.name: "cluster" for f in dataclasses.fields(config.cluster)} | _SECTION_OPTIONS
    unknown = sorted(set(options) - own - set(sections))
    if unknown:
        raise ConfigError(f"unknown fleet option {unknown[0]!r}; known: {', '.join(sorted(own | set(sections)))}")
    for section in sorted(set(sections.values())):
        overrides = {k: v for k, v in options.items() if sections.get(k) == section}
        if overrides:
            config = dataclasses.replace(config, **{section: _override(config, section, overrides)})
    _check_handoff_tp(config.cluster)
    return config, FleetConfig(**{k: v for k, v in options.items() if k in own})


def _override(config: GroupConfig, section: str, overrides: dict[str, Any]):
    current = getattr(config, section)
    try:
        return type(current).from_dict({**current.to_dict(), **overrides})
    except ConfigError as e:
        raise e.under(section) from None


def _check_handoff_tp(cluster: ClusterConfig) -> None:
    if cluster.mode != "disaggregated":
        return
    prefill, decode = role_tp_size(cluster, "prefill"), role_tp_size(cluster, "decode")
    if prefill != decode:
        raise ConfigError(f"KV hand-off needs equal tp sizes: prefill_tp_size={prefill}, decode_tp_size={decode} "
                          "(rank i of a prefill group hands its KV shard to rank i of a decode group; resharding "
                          "by kv-head slices is not implemented)", key="cluster.decode_tp_size")


def group_layout(cluster: ClusterConfig, name: str) -> list[tuple[str, Role]]:
    """(group id, role) of every group of fleet ``name``, prefill groups first."""
    if cluster.mode != "disaggregated":
        return [(f"{name}-c{i}", "colocated") for i in range(cluster.num_colocated_groups)]
    return ([(f"{name}-p{i}", "prefill") for i in range(cluster.num_prefill_groups)]
            + [(f"{name}-d{i}", "decode") for i in range(cluster.num_decode_groups)])


def role_tp_size(cluster: ClusterConfig, role: Role) -> int:
    """Tensor-parallel degree of a group of ``role``: ``decode_tp_size`` (decode) or ``prefill_tp_size``
    (prefill, colocated), else ``tp_size``."""
    size = cluster.decode_tp_size if role == "decode" else cluster.prefill_tp_size
    return size or cluster.tp_size


def role_config(config: GroupConfig, role: Role) -> GroupConfig:
    """``config`` for a group of ``role``: its tp size, graphs captured only for its phases, and no
    async scheduling on a prefill group (it hands each request off after its first token)."""
    phases = [p for p in _PHASES[role] if config.graphs.capture in ("both", p)]
    capture = "both" if len(phases) == 2 else phases[0] if phases else "none"
    scheduler = dataclasses.replace(config.scheduler, async_scheduling=False) if role == "prefill" else config.scheduler
    return dataclasses.replace(config, graphs=dataclasses.replace(config.graphs, capture=capture),
                               cluster=dataclasses.replace(config.cluster, tp_size=role_tp_size(config.cluster, role)),
                               scheduler=scheduler)
