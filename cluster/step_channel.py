"""How a group's leader (rank 0) hands each step, and each KV staging or import, to its other ranks.

The leader runs the group's engine; every other rank (a *follower*) runs :func:`follow` on a
thread of its own for the life of its generation: it receives the leader's orders in the order
they were sent and carries them out on its worker. The orders travel over a gloo process group
of their own (``StepChannel``), separate from the model's collectives (NCCL on GPUs): a
broadcast of the pickled order, then, for a KV import, a scatter of each rank's shard.

Invariants:

- Orders are totally ordered: a follower runs order k+1 only after order k, so a KV staging
  sent after step N copies what step N wrote and before step N+1 (which may reuse the pages)
  runs; an import lands before the first step that reads it.
- A follower waiting for the next order sleeps in gloo's receive (no polling); the group's
  timeout is long (:data:`IDLE_TIMEOUT`) because an idle group sends nothing. A dead leader
  closes the connection and ends the wait with an error; the driver kills the rest.
- Only the leader's result counts: every rank samples the same tokens from the same logits.
- A re-plan is an order like a step: every rank swaps its graphs between the same two steps,
  from the leader's profile, with no step in flight (the leader's engine reads back first).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from worker.executor import PendingLaunch
from worker.step_message import StepMessage, StepResult

log = logging.getLogger(__name__)

#: How long a follower may wait for its next order (an idle group sends none).
IDLE_TIMEOUT = timedelta(days=7)

STEP, STAGE, IMPORT, REPLAN, STOP = "step", "stage", "import", "replan", "stop"


class StepChannel:
    """The leader-to-followers order stream of one generation (a gloo group over all its ranks)."""

    def __init__(self, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        # new_group is collective: every rank of the generation creates it, in the same order.
        self._group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, order: tuple) -> None:
        """Leader: send ``order`` to every follower (returns once gloo has taken it)."""
        import torch.distributed as dist

        dist.broadcast_object_list([order], src=0, group=self._group)

    def receive(self) -> tuple:
        """Follower: the next order (blocks, sleeping, until the leader sends one)."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def scatter(self, items: list) -> object:
        """Leader: rank i receives ``items[i]``; returns the leader's own (``items[0]``)."""
        import torch.distributed as dist

        out = [None]
        dist.scatter_object_list(out, list(items), src=0, group=self._group)
        return out[0]

    def receive_scattered(self) -> object:
        """Follower: this rank's item of the leader's :meth:`scatter`."""
        import torch.distributed as dist

        out = [None]
        dist.scatter_object_list(out, None, src=0, group=self._group)
        return out[0]


class LeaderExecutor:
    """The leader's engine executor: each step goes to the followers first, then runs here.

    ``submit`` sends the step to every follower at once and returns a step that runs on the
    leader's worker when its result is asked for; steps run in submission order on every rank,
    so a step's ``from_previous`` inputs refer to the step submitted before it everywhere.
    """

    def __init__(self, worker, channel: StepChannel | None) -> None:
        self.worker, self.channel = worker, channel
        self.arch = worker.arch
        self.num_pages = worker.num_pages
        self.max_len = worker.max_len

    def submit(self, msg: StepMessage) -> PendingLaunch:
        if self.channel is not None:
            self.channel.send((STEP, msg))
        return PendingLaunch(self.worker, msg)

    def execute(self, msg: StepMessage) -> StepResult:
        return self.submit(msg).result()

    def padding_since_plan(self) -> dict[str, tuple[float, int]]:
        """The leader's :meth:`worker.worker.Worker.padding_since_plan` (every rank runs the same batches)."""
        return self.worker.padding_since_plan()

    def replan(self, profile=None):
        """Re-plan every rank's graphs from one profile (the leader's, unless given), all at once.

        Every rank measures and captures together (a tensor-parallel forward runs collectives, even
        while it is being measured), from the same profile and budget, so they keep the same shapes.
        A refusal (``ValueError``) is the leader's to report; a follower that refuses keeps its graphs
        and logs it, as the leader does (both refuse on the same numbers)."""
        profile = profile if profile is not None else self.worker.profile()
        if self.channel is not None:
            self.channel.send((REPLAN, profile))
        return self.worker.replan(profile)

    def shutdown(self) -> None:
        """Tell the followers to stop (the worker itself is the rank actor's to release)."""
        if self.channel is not None:
            try:
                self.channel.send((STOP,))
            except RuntimeError as e:  # a follower is gone already
                log.info("stop order not delivered: %s", e)


def follow(channel: StepChannel, worker, stage, import_shard) -> None:
    """A follower's loop: run the leader's orders until it sends ``STOP``.

    ``stage(transfer_id, pages)`` copies pages for a hand-off; ``import_shard(pages, transport,
    shard)`` writes this rank's shard of an imported request's KV. An error (a broken channel, a
    failed step) ends the loop by raising: the group is failed by whoever watches this rank.
    """
    while True:
        order = channel.receive()
        kind = order[0]
        if kind == STEP:
            worker.launch(order[1], read_back=False)  # tokens stay on the device for the next step's inputs
        elif kind == STAGE:
            stage(order[1], order[2])
        elif kind == IMPORT:
            _, pages, transport = order
            import_shard(pages, transport, channel.receive_scattered())
        elif kind == REPLAN:
            try:
                worker.replan(order[1])
            except ValueError as e:
                log.info("re-plan refused on this rank (the leader reports it): %s", e)
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown order {kind!r} from the leader")
