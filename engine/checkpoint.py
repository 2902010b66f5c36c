"""A HuggingFace checkpoint folder: config.json and one or many *.safetensors.

With `model.safetensors.index.json` the index's weight map says which file holds
each tensor (and every file it names must exist and hold what it says); without
one, every *.safetensors file in the folder is read and a name in two files is
an error. Tensors are read one at a time, on demand (safetensors memory-maps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    pass


def read_config(path: str | Path) -> dict[str, Any]:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json (not a HuggingFace checkpoint folder)")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: must hold a JSON object")
    return cfg


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no weight_map")
            for name, fname in weight_map.items():
                self._file_of[name] = self.path / fname
            for f in sorted(set(self._file_of.values())):
                if not f.is_file():
                    raise CheckpointError(f"{index} names {f.name}, which does not exist")
                held = set(self._open(f).keys())
                claimed = {n for n, g in self._file_of.items() if g == f}
                if claimed - held:
                    raise CheckpointError(f"{f.name} lacks {sorted(claimed - held)[0]!r}, which {INDEX_FILE} puts there")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files")
            for f in files:
                for name in self._open(f).keys():
                    if name in self._file_of:
                        raise CheckpointError(f"tensor {name!r} is in both {self._file_of[name].name} and {f.name}")
                    self._file_of[name] = f

    def _open(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._open(self._file_of[name]).get_tensor(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._file_of:
            yield name, self.get(name)
