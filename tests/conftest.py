"""Shared fixtures: real HF-format checkpoints written once per test session."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (worker/sampling/fused_logprobs.py) run on CPU tensors only in Triton's
    # interpreter, which is chosen when triton is first imported; GPU runs compile them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def gpu_memory_given_back(request):
    """After each GPU test, the caching allocator's free blocks go back to the device: a test that
    sized its KV cache at ``gpu_memory_fraction=1.0`` otherwise leaves ~138 GiB reserved in this
    process and every later GPU test of the run fails with an out-of-memory error."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


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
def fresh_dynamo():
    """torch.compile's state reset before and after a module: compiled code and its guards are
    process-wide (graphs/piecewise.py), so a module starts clean and leaves nothing behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A two-layer tiny-llama checkpoint (the compile tests' model: compiles in seconds on CPU)."""
    import dataclasses

    from worker.checkpoint import write_checkpoint
    from worker.checkpoint.catalog import get_preset

    preset = dataclasses.replace(get_preset("tiny-llama"), name="tiny-llama-2l", num_hidden_layers=2)
    return write_checkpoint(preset, tmp_path_factory.mktemp("two-layers") / "tiny-llama-2l", seed=0)


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
