"""Reading tensors (or one rank's slice of them) from HF safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.arch import CheckpointError


class SafetensorsCheckpoint:
    """Index of every tensor in a checkpoint directory (single file or sharded with an index).

    ``read`` returns a full tensor or a contiguous slice along one dimension, reading only that
    slice from disk, and checks the stored shape against the expected full shape first.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        self._file_of: dict[str, Path] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: missing 'weight_map'")
            for name, fname in weight_map.items():
                self._file_of[name] = self.model_dir / fname
            for f in set(self._file_of.values()):
                if not f.is_file():
                    raise CheckpointError(f"{index}: names shard {f.name}, which is missing")
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.model_dir}: no *.safetensors files")
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():
                        self._file_of[name] = f
        self._handles: dict[Path, object] = {}
        self.names_read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"{self.model_dir}: missing tensor '{name}'")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def read(
        self,
        name: str,
        expected_shape: tuple[int, ...],
        dim: int | None = None,
        start: int = 0,
        length: int | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` (checked against ``expected_shape``), or ``[start:start+length]`` along ``dim``."""
        sl = self._handle(name).get_slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"{self.model_dir}: tensor '{name}' has shape {list(shape)}, expected {list(expected_shape)}"
            )
        self.names_read.add(name)
        if dim is None:
            return sl[:]
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, start + (shape[dim] - start if length is None else length))
        return sl[tuple(index)]

    def unused(self) -> list[str]:
        return sorted(set(self._file_of) - self.names_read)

    def close(self) -> None:
        self._handles.clear()
