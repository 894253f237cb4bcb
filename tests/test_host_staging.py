"""worker.host_staging: a step's small inputs staged through pinned buffers in one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.host_staging import PinnedStaging


def test_cpu_staging_gives_each_part_as_its_own_tensor():
    s = PinnedStaging("cpu")
    ids, empty, rows = s.stage([[5, 6, 7], [], np.array([2], dtype=np.int64)])
    assert ids.tolist() == [5, 6, 7] and empty.numel() == 0 and rows.tolist() == [2]
    assert ids.dtype == torch.int64 and empty.dtype == torch.int64
    again, = s.stage([[1, 2, 3]])
    assert ids.tolist() == [5, 6, 7] and again.tolist() == [1, 2, 3]  # nothing shared between calls


def test_a_ring_needs_two_slots():
    with pytest.raises(ValueError, match="slots must be >= 2"):
        PinnedStaging("cpu", slots=1)


@pytest.mark.gpu
def test_gpu_staging_reuses_a_slot_only_after_its_copy_ran():
    """While the device is busy with work queued before them, staged inputs are consumed with the
    values they were staged with, though the ring comes round to their slot again (its host
    buffer is rewritten only after its copy ran); a call larger than a slot grows it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (make test-gpu)")
    s = PinnedStaging("cuda", capacity=8, slots=2)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the stream busy, so the copies below queue behind it
        big = big @ big
        big /= big.norm()
    consumed = []
    for i in range(6):  # three times round the ring
        a, b = s.stage([[i] * 5, list(range(i, i + 3))])
        consumed.append(torch.cat([a, b]) * 1)  # a kernel that reads the views, queued now
    for i, got in enumerate(consumed):
        assert got.tolist() == [i] * 5 + list(range(i, i + 3))
    grown = s.stage([list(range(100))])[0]
    assert grown.tolist() == list(range(100))
