"""What crosses the process boundary between the fleet and a group's leader, per step at most.

The fleet sends *commands* in numbered batches (:meth:`cluster.fleet_rank.FleetRankActor.engine_commands`);
the leader sends one :class:`GroupReport` per step at most over its report link
(:mod:`cluster.report_link`): every event since the last report, the
hand-offs staged, the hand-offs admitted or refused, and the engine's load. Requests are named by
their *engine id* (the fleet's request id plus its placement number), so a late event of an
earlier placement of a request is never mistaken for one of the current placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.outputs import RequestEvent, events_from_wire, events_to_wire
from worker.sampling.params import SamplingParams


@dataclass(frozen=True)
class Admit:
    """Prefill ``prompt_ids + output_ids`` and sample output token ``len(output_ids)`` with ``seed``;
    ``hand_off``: stage the KV after that token and end the request here with reason "handoff";
    ``expected_cached_tokens``: the prefix the router expects this group to have cached (its load
    counts the request's prefill as the rest while it waits: :meth:`fleet.router.Router.prefill_work`)."""

    engine_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int]
    logprobs: list[float]
    hand_off: bool
    expected_cached_tokens: int = 0


@dataclass(frozen=True)
class Prefilled:
    """Admit a request whose KV comes from a prefill group: ``shards`` (one per rank, in the form
    ``transport`` gives them: see :mod:`cluster.kv_transport`) hold the KV of every token but the last."""

    engine_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int
    logprobs: list[float]
    transport: str
    shards: tuple
    timeout_s: float


@dataclass(frozen=True)
class Abort:
    """End ``engine_id`` here and free its pages (nothing is reported for it)."""

    engine_id: str


@dataclass(frozen=True)
class Replan:
    """Re-plan the group's graph ladders from what it has run, between two steps (every rank)."""

    replan_id: str


@dataclass(frozen=True)
class Replanned:
    """A :class:`Replan`'s result: the summary (:meth:`graphs.budget.ReplanSummary.to_dict`) or why it
    was refused."""

    replan_id: str
    summary: dict | None
    error: str | None = None


@dataclass(frozen=True)
class Staged:
    """A request's KV, copied on every rank under ``transfer_id`` for a hand-off (or ``error``)."""

    transfer_id: str | None
    num_pages: int
    num_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class Refused:
    """A :class:`Prefilled` the leader did not admit.

    ``kind``: ``no_room`` (no free running slot or pages now: try again later), ``rejected`` (it
    can never run here), ``transfer_failed`` (the KV did not arrive). ``fail_group``: the group's
    pages may still be written by the failed transfer (a timeout, or a follower mid-import), so
    the group must be failed.
    """

    engine_id: str
    kind: str
    message: str
    fail_group: bool = False


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load as of a report: what the router weighs."""

    free_pages: int
    num_usable: int
    requests: int
    outstanding_tokens: int


@dataclass
class GroupReport:
    """Everything a group's engine did since its last report.

    ``applied``: the number of the last command batch applied before ``load`` was taken (0 with no
    ``load``: nothing to say);
    ``step_s``: how long the step running now has run (0 when none runs); ``loop_error``: the
    engine loop ended with this error (the group is dead); ``replans``: re-plans done.
    """

    events: list[RequestEvent] = field(default_factory=list)
    staged: dict[str, Staged] = field(default_factory=dict)
    accepted: list[str] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    load: EngineLoad | None = None
    applied: int = 0
    step_s: float = 0.0
    loop_error: str | None = None
    replans: list[Replanned] = field(default_factory=list)

    def __reduce__(self):
        # The events travel as columns: pickle runs a Python-level reducer per dataclass, and the
        # leader's report thread pickles while holding the GIL its engine loop needs.
        return (_unpack_report, (events_to_wire(self.events), self.staged, self.accepted, self.refused, self.load,
                                 self.applied, self.step_s, self.loop_error, self.replans))


def _unpack_report(events, staged, accepted, refused, load, applied, step_s, loop_error, replans) -> GroupReport:
    return GroupReport(events_from_wire(events), staged, accepted, refused, load, applied, step_s, loop_error,
                       replans)
