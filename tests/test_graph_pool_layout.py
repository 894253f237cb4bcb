"""graphs.pool_layout on the CPU: the config's values, the measurement and the presizing change
nothing off CUDA, and the setting reaches every backend the worker builds (the GPU side:
tests/test_graph_memory_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from configkit import ConfigError
from graphs.backends import create_backend
from graphs.config import GraphsConfig
from graphs.layout import one_block_bytes
from graphs.process import after_free_block, presize_bytes


def test_pool_layout_accepts_grown_and_presized_and_names_anything_else():
    assert GraphsConfig().pool_layout == "grown"
    assert GraphsConfig.from_dict({"pool_layout": "presized"}).pool_layout == "presized"
    with pytest.raises(ConfigError, match="pool_layout: invalid value 'expandable'; allowed: grown, presized"):
        GraphsConfig.from_dict({"pool_layout": "expandable"})


def test_off_cuda_no_block_is_asked_for_and_a_debug_capture_goes_through():
    cpu = torch.device("cpu")
    assert one_block_bytes([]) == 0
    assert presize_bytes((0, 1), cpu, 1 << 30) == 0
    calls = []
    assert after_free_block(calls.clear, 0, cpu) == calls.clear  # no block: the capture runs fn itself
    after_free_block(lambda: calls.append(1), 1 << 20, cpu)()
    assert calls == [1]
    backend = create_backend("debug", cpu, presize_pool=True)
    out = torch.zeros(2)
    backend.capture(1, lambda: out.add_(1), phase="decode")
    backend.replay(1)
    assert backend.presize_pool and out.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("layout", ["grown", "presized"])
def test_the_setting_reaches_every_backend_the_worker_builds_and_a_replan_keeps_it(checkpoint_dir, layout):
    """graphs.pool_layout from the config to the decode and prefill backends of the worker (the
    debug backend on the CPU: the same construction path), and again after a live re-plan."""
    from deploy.config import load_config
    from worker.engine import Engine

    engine = Engine(load_config(None, [f"model.path={checkpoint_dir('tiny-llama')}", "model.device=cpu",
                                       "graphs.debug=true", "cache.num_pages=128", "graphs.decode.max_batch_size=4",
                                       "scheduler.chunked_prefill_size=64", "scheduler.max_num_batched_tokens=64",
                                       f"graphs.pool_layout={layout}"]))
    try:
        worker = engine.worker
        runners = (worker.runner.decode_runner, worker.runner.prefill_runner)
        assert [r.backend.presize_pool for r in runners] == [layout == "presized"] * 2
        worker.replan()
        runners = (worker.runner.decode_runner, worker.runner.prefill_runner)
        assert [r.backend.presize_pool for r in runners] == [layout == "presized"] * 2
    finally:
        engine.shutdown()
