"""Fixtures shared by test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_checkpoints import save_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama checkpoint (read-only: tests start engines on it)."""
    path = tmp_path_factory.mktemp("llama")
    save_checkpoint("llama", path)
    return path
