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
