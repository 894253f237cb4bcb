"""The stream batching interval follows the load (deploy.stream_pacing.StreamPacer)."""

from __future__ import annotations

import pytest

from deploy.stream_pacing import StreamPacer


def test_a_lone_stream_gets_every_token_and_a_busy_replica_coalesces_up_to_the_ceiling():
    pacer = StreamPacer(ceiling_s=0.050, chunks_per_s=2000.0)
    assert pacer.interval_s() == 0.0
    pacer.open(1)
    assert pacer.interval_s() == pytest.approx(0.0005)  # below any step: every token as it comes
    pacer.open(63)
    assert pacer.interval_s() == pytest.approx(0.032)  # 64 streams share 2,000 chunks a second
    pacer.open(1000)
    assert pacer.interval_s() == 0.050  # never longer than the ceiling
    pacer.close(1000)
    pacer.close(64)
    assert pacer.open_streams == 0 and pacer.interval_s() == 0.0


def test_no_budget_is_the_fixed_interval():
    pacer = StreamPacer(ceiling_s=0.050, chunks_per_s=None)
    assert pacer.interval_s() == 0.050
    pacer.open(3)
    assert pacer.interval_s() == 0.050


@pytest.mark.parametrize("ceiling, rate, what", [(-1.0, 10.0, "ceiling_s"), (0.05, 0.0, "chunks_per_s"),
                                                 (0.05, -5.0, "chunks_per_s")])
def test_bad_settings_name_the_setting(ceiling, rate, what):
    with pytest.raises(ValueError, match=what):
        StreamPacer(ceiling, rate)
