"""Iterate a Hugging Face checkpoint's tensors from its safetensors files.

Tensors are yielded one at a time so a model can copy each into place without holding
the whole checkpoint in memory twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The shard files to read: those the index names, or every *.safetensors, sorted."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist or is not a directory")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return _files_from_index(index_path)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files (and no {INDEX_FILE})")
    return files


def _files_from_index(index_path: Path) -> list[Path]:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index_path}: malformed index (needs a 'weight_map' object): {e}") from e
    if not shard_names:
        raise ValueError(f"{index_path}: weight_map is empty")
    files = [index_path.parent / name for name in shard_names]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{index_path}: names shard {f.name!r}, which does not exist")
    return files


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in the checkpoint, on the CPU."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - the handle is not iterable
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{path}: cannot read safetensors file (corrupt or truncated?): {e}"
            ) from e
