"""graphs.pool_segments on the CPU: the config's values, and the switch leaves a CPU device and a
process already on expandable segments alone (the GPU side: tests/test_graph_memory_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from configkit import ConfigError
from graphs.backends import create_backend
from graphs.config import GraphsConfig
from graphs.process import _process_expandable, expandable_pool_segments


def test_pool_segments_accepts_fixed_and_expandable_and_names_anything_else():
    assert GraphsConfig().pool_segments == "fixed"
    assert GraphsConfig.from_dict({"pool_segments": "expandable"}).pool_segments == "expandable"
    with pytest.raises(ConfigError, match="pool_segments: invalid value 'paged'; allowed: fixed, expandable"):
        GraphsConfig.from_dict({"pool_segments": "paged"})


@pytest.mark.parametrize("conf, on", [("expandable_segments:True", True),
                                      ("max_split_size_mb:128, expandable_segments: true", True),
                                      ("expandable_segments:False", False), ("", False)])
def test_a_process_started_with_expandable_segments_is_recognized(monkeypatch, conf, on):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert _process_expandable() is on
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    assert _process_expandable() is on


def test_the_switch_changes_nothing_off_cuda_and_a_debug_capture_goes_through_it():
    with expandable_pool_segments(torch.device("cpu"), True):
        x = torch.ones(4)
    assert x.sum().item() == 4
    backend = create_backend("debug", torch.device("cpu"), expandable_pool=True)
    out = torch.zeros(2)
    backend.capture(1, lambda: out.add_(1), phase="decode")
    backend.replay(1)
    assert backend.expandable_pool and out.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("segments", ["fixed", "expandable"])
def test_the_setting_reaches_every_backend_the_worker_builds_and_a_replan_keeps_it(checkpoint_dir, segments):
    """graphs.pool_segments from the config to the decode and prefill backends of the worker (the
    debug backend on the CPU: the same construction path), and again after a live re-plan."""
    from deploy.config import load_config
    from worker.engine import Engine

    engine = Engine(load_config(None, [f"model.path={checkpoint_dir('tiny-llama')}", "model.device=cpu",
                                       "graphs.debug=true", "cache.num_pages=128", "graphs.decode.max_batch_size=4",
                                       "scheduler.chunked_prefill_size=64", "scheduler.max_num_batched_tokens=64",
                                       f"graphs.pool_segments={segments}"]))
    try:
        worker = engine.worker
        runners = (worker.runner.decode_runner, worker.runner.prefill_runner)
        assert [r.backend.expandable_pool for r in runners] == [segments == "expandable"] * 2
        worker.replan()
        runners = (worker.runner.decode_runner, worker.runner.prefill_runner)
        assert [r.backend.expandable_pool for r in runners] == [segments == "expandable"] * 2
    finally:
        engine.shutdown()
