"""launch/client/hub.py: what --model names, a directory or a Hub id, decided without the
network (fetching from the cache is in tests/worker/test_model_files.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.client.hub import HUB_FILES, HUB_SKIP, ModelNotFoundError, is_hub_id, resolve_model


@pytest.mark.parametrize(
    ("spec", "hub"),
    [
        ("meta-llama/Llama-3.2-1B", True),
        ("Qwen/Qwen2.5-0.5B-Instruct@main", True),
        ("org/name@refs/pr/1", True),
        ("org/name@v1.0", True),
        ("name-only", False),
        ("/abs/path", False),
        ("./org/name", False),
        ("a/b/c", False),
        ("org/..", False),
        ("org/name@", False),
        ("-org/name", False),
    ],
)
def test_a_hub_id_is_org_slash_name_with_an_optional_revision(spec: str, hub: bool) -> None:
    assert is_hub_id(spec) is hub


def test_an_existing_directory_wins_even_when_it_reads_as_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == "org/name"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_file_or_a_missing_path_that_is_no_hub_id_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face Hub id"):
        resolve_model(str(tmp_path / "missing"))


def test_only_safetensors_weights_and_configs_are_fetched() -> None:
    assert "*.safetensors" in HUB_FILES and "config.json" in HUB_FILES
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in HUB_FILES)
    assert "original/*" in HUB_SKIP
