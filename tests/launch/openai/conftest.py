"""The server tests' fixtures: a server on the chat model (one per test module), a
starter of servers on the built-in model, LLM.generate's reference answers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from launch import LLM
from tests.helpers.cli_helpers import CPU
from tests.helpers.model_files import CONVERSATION
from tests.helpers.server import (
    GREEDY,
    PROMPT_IDS,
    PROMPT_TEXT,
    Server,
    start_server,
)


@pytest.fixture(scope="module")
def reference(chat_model: Path) -> dict[str, list[int]]:
    """LLM.generate's greedy token ids for each prompt the tests send."""
    with LLM(str(chat_model), device=CPU) as llm:
        text, ids = llm.generate([PROMPT_TEXT, PROMPT_IDS], GREEDY, use_tqdm=False)
        (chat,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    return {"text": text.token_ids, "ids": ids.token_ids, "chat": chat.token_ids}


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(chat_model, tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture
def builtin_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Starts a server on the built-in model (4096 positions: long requests) with flags;
    whatever a failing test left running is stopped."""
    started: list[Server] = []

    def start(*flags: str) -> Server:
        started.append(start_server(None, tmp_path / f"server{len(started)}", *flags))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
