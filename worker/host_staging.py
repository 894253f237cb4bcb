"""Pinned host staging for a step's small host-to-device inputs.

``torch.tensor(ids).to("cuda", non_blocking=True)`` copies from pageable memory, and such a copy
is not asynchronous: the driver stages it through a bounce buffer of its own and the host thread
waits, in the profiles on the H200 until the step in flight was done. With async scheduling that
wait serialised the next step's launch behind the running one (a quarter of the leader's engine
loop at batch 64 sat in ``ModelRunner.prepare``). A :class:`PinnedStaging` fills a pinned buffer
through numpy and issues one truly asynchronous copy per call.

Invariant (owner: :class:`PinnedStaging`): a slot's host buffer is rewritten only after the device
consumed the copy made from it (one CUDA event per slot), and its device buffer only by a later
copy on the same stream, so the views a call returns stay valid until ``slots`` more calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PinnedStaging:
    """A ring of ``slots`` (pinned host buffer, device buffer) pairs of ``dtype`` for ``device``.

    :meth:`stage` copies several int sequences to the device in one copy and returns a device view
    of each. On a CPU device there is nothing to copy: each part becomes a tensor of its own.
    A call larger than the slot's capacity grows that slot.
    """

    def __init__(self, device: torch.device | str, capacity: int = 1024, dtype: torch.dtype = torch.int64,
                 slots: int = 3) -> None:
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (a slot is rewritten while the step before runs), got {slots}")
        self.device = torch.device(device)
        self.dtype = dtype
        self._pinned = self.device.type == "cuda"
        self._slots: list[tuple[torch.Tensor, np.ndarray, torch.Tensor, torch.cuda.Event] | None] = [None] * slots
        self._capacity = max(1, capacity)
        self._next = 0

    def _slot(self, need: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, torch.cuda.Event]:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        if slot is not None and slot[0].numel() >= need:
            slot[3].synchronize()  # its last copy was consumed (steps ago, in a running loop)
            return slot
        size = max(self._capacity, need, 2 * (slot[0].numel() if slot is not None else 0))
        host = torch.empty(size, dtype=self.dtype, pin_memory=True)
        slot = (host, host.numpy(), torch.empty(size, dtype=self.dtype, device=self.device), torch.cuda.Event())
        self._slots[i] = slot
        return slot

    def stage(self, parts: Sequence[Sequence[int] | np.ndarray]) -> list[torch.Tensor]:
        """Device tensors (1-D, ``dtype``) holding each of ``parts``; queued, not waited for."""
        if not self._pinned:
            return [torch.as_tensor(np.asarray(p), dtype=self.dtype).to(self.device) for p in parts]
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        host, host_np, dev, event = self._slot(total)
        off = 0
        for p, n in zip(parts, sizes):
            host_np[off: off + n] = p
            off += n
        if total:
            dev[:total].copy_(host[:total], non_blocking=True)
        event.record()
        views, off = [], 0
        for n in sizes:
            views.append(dev[off: off + n])
            off += n
        return views
