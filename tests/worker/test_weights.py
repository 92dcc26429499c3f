"""worker/weights.py: tensors streamed from a checkpoint's safetensors files, and errors that
name the file at fault."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.weights import INDEX_FILE, iterate_weights, safetensors_files


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("no *.safetensors")):
        list(iterate_weights(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ValueError, match=re.escape("model.safetensors")):
        list(iterate_weights(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match=re.escape("model-00002-of-00002.safetensors")):
        list(iterate_weights(tmp_path))


def test_tensors_of_every_shard_an_index_names_come_back_unchanged(tmp_path: Path) -> None:
    a, b, c = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.float16), torch.zeros(1)
    save_file({"a": a, "b": b}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": c}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"stray": c}, str(tmp_path / "not-in-the-index.safetensors"))
    weight_map = {"c": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"}
    weight_map["b"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))

    assert [p.name for p in safetensors_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    got = dict(iterate_weights(tmp_path))
    assert sorted(got) == ["a", "b", "c"]
    for name, want in {"a": a, "b": b, "c": c}.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want)


def test_without_an_index_every_safetensors_file_is_read_in_name_order(tmp_path: Path) -> None:
    save_file({"y": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    assert [p.name for p in safetensors_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    assert [name for name, _ in iterate_weights(tmp_path)] == ["x", "y"]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("{not json", "malformed index"),
        (json.dumps({"shards": []}), "needs a 'weight_map'"),
        (json.dumps({"weight_map": {}}), "weight_map is empty"),
    ],
)
def test_a_bad_index_is_named_with_what_is_wrong(tmp_path: Path, index: str, message: str) -> None:
    (tmp_path / INDEX_FILE).write_text(index)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        safetensors_files(tmp_path)
    assert INDEX_FILE in str(info.value)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        safetensors_files(tmp_path / "nope")
