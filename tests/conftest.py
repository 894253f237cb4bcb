"""Shared fixtures: real HF-format checkpoints written once per test session."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(preset)`` -> directory of a freshly written checkpoint (cached per session)."""
    from worker.checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[tuple[str, str], object] = {}

    def make(preset: str, dtype: str = "float32"):
        key = (preset, dtype)
        if key not in made:
            made[key] = write_checkpoint(preset, root / f"{preset}-{dtype}", seed=0, dtype=dtype)
        return made[key]

    return make


@pytest.fixture(scope="module")
def ray_local(request):
    """A local CPU Ray on 127.0.0.1 for one module, with the module's ``RAY_CPUS`` logical CPUs (default 8)."""
    ray = pytest.importorskip("ray")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=getattr(request.module, "RAY_CPUS", 8), include_dashboard=False,
             log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_gpu():
    """A local Ray on 127.0.0.1 with this machine's GPUs (the GPU cluster and fleet tests)."""
    ray = pytest.importorskip("ray")
    ray.init(_node_ip_address="127.0.0.1", num_cpus=8, num_gpus=torch.cuda.device_count(),
             include_dashboard=False, ignore_reinit_error=True)
    yield
    ray.shutdown()
