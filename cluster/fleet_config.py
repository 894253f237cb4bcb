"""Fleet settings: the group layout per role and the router's limits, on top of :class:`GroupConfig`."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Literal

from cluster.config import GroupConfig
from configkit import ConfigError, with_overrides

Role = Literal["colocated", "prefill", "decode"]

_PHASES = {"colocated": ("prefill", "decode"), "prefill": ("prefill",), "decode": ("decode",)}


@dataclass(frozen=True)
class FleetConfig:
    """How a :class:`cluster.fleet.Fleet` lays out its groups and admits requests.

    mode: "colocated" = one group prefills and decodes; "disaggregated" = prefill groups hand
        each request's KV to decode groups.
    num_prefill_groups, num_decode_groups: groups per role (disaggregated only).
    prefill_tp_size, decode_tp_size: tensor-parallel degree of each role's groups; the KV
        hand-off needs them equal.
    kv_transport: how KV moves from prefill to decode ranks (see cluster.kv_transport).
    max_queued_requests: new requests waiting for a group; one more raises ``Overloaded``.
    request_timeout_s: default deadline of a request from submission; None = no deadline.
    max_attempts: times a request may be prefilled (the first time included) before group
        failures end it with an error.
    handoff_timeout_s: bound on one KV import into a decode group.
    lost_after_s: a dead group not restarting after this long (or with cluster.restart off) is
        lost: requests that need its role and have no other group end with an error.
    idle_poll_s: how long the loop waits for work when there is none.
    name: prefix of the group ids (Ray actor names must be unique); None = a random one.
    """

    mode: Literal["colocated", "disaggregated"] = "colocated"
    num_prefill_groups: int = 1
    num_decode_groups: int = 1
    prefill_tp_size: int = 1
    decode_tp_size: int = 1
    kv_transport: str = "object_store"
    max_queued_requests: int = 4096
    request_timeout_s: float | None = None
    max_attempts: int = 3
    handoff_timeout_s: float = 60.0
    lost_after_s: float = 60.0
    idle_poll_s: float = 0.02
    name: str | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, key: str, reason: str) -> None:
            if not ok:
                raise ConfigError(reason, key=f"fleet.{key}")

        check(self.mode in ("colocated", "disaggregated"), "mode",
              f"must be 'colocated' or 'disaggregated', got {self.mode!r}")
        for key in ("num_prefill_groups", "num_decode_groups", "prefill_tp_size", "decode_tp_size",
                    "max_queued_requests", "max_attempts"):
            value = getattr(self, key)
            check(isinstance(value, int) and value >= 1, key, f"must be an int >= 1, got {value!r}")
        for key in ("handoff_timeout_s", "lost_after_s", "idle_poll_s"):
            check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)!r}")
        t = self.request_timeout_s
        check(t is None or t > 0, "request_timeout_s", f"must be > 0 or None, got {t!r}")
        if self.name is None:
            object.__setattr__(self, "name", f"fleet-{uuid.uuid4().hex[:6]}")
        if self.disaggregated:
            check(self.prefill_tp_size == self.decode_tp_size, "decode_tp_size",
                  f"KV hand-off needs equal tp sizes: prefill_tp_size={self.prefill_tp_size}, "
                  f"decode_tp_size={self.decode_tp_size} (rank i of a prefill group hands its KV shard to rank i "
                  "of a decode group; resharding by kv-head slices is not implemented)")

    @classmethod
    def from_config(cls, config: GroupConfig, **options) -> FleetConfig:
        """Defaults from ``config`` (the ``cluster`` section, ``serve.request_timeout_s``,
        ``scheduler.max_waiting_requests``), then ``options`` (field names of this class)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown fleet option {unknown[0]!r}; known: {', '.join(sorted(known))}",
                              key=f"fleet.{unknown[0]}")
        c = config.cluster
        base = {"mode": c.mode, "num_prefill_groups": c.num_prefill_groups, "num_decode_groups": c.num_decode_groups,
                "prefill_tp_size": c.prefill_tp_size or c.tp_size, "decode_tp_size": c.decode_tp_size or c.tp_size,
                "kv_transport": c.kv_transport, "handoff_timeout_s": c.handoff_timeout_s,
                "lost_after_s": c.lost_after_s, "max_attempts": c.max_attempts,
                "request_timeout_s": config.serve.request_timeout_s,
                "max_queued_requests": config.scheduler.max_waiting_requests}
        return cls(**{**base, **options})

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    def groups(self) -> list[tuple[str, Role]]:
        """(group id, role) of every group, prefill groups first."""
        prefix = self.name
        if not self.disaggregated:
            return [(f"{prefix}-c0", "colocated")]
        return ([(f"{prefix}-p{i}", "prefill") for i in range(self.num_prefill_groups)]
                + [(f"{prefix}-d{i}", "decode") for i in range(self.num_decode_groups)])

    def tp_size(self, role: Role) -> int:
        return self.decode_tp_size if role == "decode" else self.prefill_tp_size

    def role_config(self, config: GroupConfig, role: Role) -> GroupConfig:
        """``config`` for a group of ``role``: its tp size, graphs captured only for its phases, and no
        async scheduling on a prefill group."""
        phases = [p for p in _PHASES[role] if config.graphs.capture in ("both", p)]
        capture = "both" if len(phases) == 2 else phases[0] if phases else "none"
        overrides = [f"graphs.capture={capture}", f"cluster.tp_size={self.tp_size(role)}"]
        if role == "prefill":  # a prefill group hands each request off after its first token
            overrides.append("scheduler.async_scheduling=false")
        return with_overrides(config, overrides)
