"""graphs.pool_layout on the CPU: the config's values; graphs.layout's candidate limits, choice and
reasons to leave the allocator alone; nothing tuned off CUDA; the setting reaches every backend the
worker builds (the GPU side, against the caching allocator and real captures:
tests/test_graph_memory_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from configkit import ConfigError
from graphs.backends import create_backend
from graphs.config import GraphsConfig
from graphs.layout import (
    MIB,
    candidate_limits_mb,
    chosen_limit,
    process_settings,
    split_limit,
    tuned_split_limit,
    why_not_tuned,
)


def test_pool_layout_accepts_grown_and_tuned_and_names_anything_else():
    assert GraphsConfig().pool_layout == "grown"
    assert GraphsConfig.from_dict({"pool_layout": "tuned"}).pool_layout == "tuned"
    with pytest.raises(ConfigError, match="pool_layout: invalid value 'presized'; allowed: grown, tuned"):
        GraphsConfig.from_dict({"pool_layout": "presized"})


def test_candidates_are_each_large_size_in_whole_mib_above_the_allocators_floor():
    """A limit of n MiB makes requests of n MiB and more unsplittable: one candidate per distinct
    whole-MiB size above 20 (the allocator refuses 20 and less), ascending; small requests add none."""
    sizes = [512, 1 * MIB, 10 * MIB, 20 * MIB + 4096, 21 * MIB, 40 * MIB + 512, 40 * MIB, 176 * MIB, 88 * MIB]
    assert candidate_limits_mb(sizes) == [21, 40, 88, 176]
    assert candidate_limits_mb([MIB, 2 * MIB]) == []


def test_the_fewest_bytes_win_and_the_default_wins_ties():
    assert chosen_limit({None: 438 * MIB, 40: 380 * MIB, 88: 380 * MIB, 176: 400 * MIB}) == 40
    assert chosen_limit({None: 100, 40: 100}) is None
    assert chosen_limit({}) is None


def test_an_operators_own_split_limit_or_another_backend_is_left_alone(monkeypatch):
    assert why_not_tuned("") is None
    assert why_not_tuned("expandable_segments:False,garbage_collection_threshold:0.8") is None
    assert why_not_tuned("backend:native") is None
    assert "max_split_size_mb:512 already" in why_not_tuned("expandable_segments:False, max_split_size_mb:512")
    assert "cudaMallocAsync allocator backend" in why_not_tuned("backend:cudaMallocAsync")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert process_settings() == "max_split_size_mb:64"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert process_settings() == "garbage_collection_threshold:0.6"  # the newer variable wins


def test_off_cuda_nothing_is_tuned_and_a_debug_capture_goes_through():
    cpu = torch.device("cpu")
    assert tuned_split_limit(cpu, lambda pool: pytest.fail("no trial capture off CUDA")) == {}
    with split_limit(None):  # no limit: the allocator is not touched
        pass
    backend = create_backend("debug", cpu, tune_split=True)
    out = torch.zeros(2)
    backend.capture(1, lambda: out.add_(1), phase="decode")
    backend.replay(1)
    assert backend.tune_split and backend.split_trials == {} and out.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("layout", ["grown", "tuned"])
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
        assert [r.backend.tune_split for r in runners] == [layout == "tuned"] * 2
        worker.replan()
        runners = (worker.runner.decode_runner, worker.runner.prefill_runner)
        assert [r.backend.tune_split for r in runners] == [layout == "tuned"] * 2
    finally:
        engine.shutdown()
