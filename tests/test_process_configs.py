"""The core's and workers' logging and self-checks come in their configs, not in the
environment: the log level given to LLM reaches both processes, a bad one is refused
before any starts, and PAGEDSERVE_CHECK_INVARIANTS=1 is read by the launcher and handed
to the core, which then checks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec
import pytest
from cli_helpers import CPU, children_of

from launch import LLM, AsyncLLM, SamplingParams
from launch.engine import CHECK_INVARIANTS_ENV
from protocol.config import EngineCoreConfig

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# INFO lines each process writes once at start-up.
CORE_INFO = "pagedserve.core: engine core: waiting for 1 worker(s)"
WORKER_INFO = "pagedserve.worker: worker rank 0: loading"
CHECKS_ON = "pagedserve.core: engine core: checking the KV invariants after every step"


def _core_config(llm: LLM) -> EngineCoreConfig:
    """The config the running core was started with: the JSON on its command line."""
    return msgspec.json.decode(llm.engine.procs["engine core"].args[-1], type=EngineCoreConfig)


@pytest.mark.parametrize(("level", "logged"), [("info", True), ("WARNING", False)])
def test_the_log_level_given_to_llm_is_the_core_and_worker_level(
    level: str, logged: bool, llama_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The children write to the stderr they inherited: capfd reads the file descriptor.
    with LLM(str(llama_dir), log_level=level, device=CPU) as llm:
        assert _core_config(llm).log_level == level.upper()
    err = capfd.readouterr().err
    assert (CORE_INFO in err, WORKER_INFO in err) == (logged, logged), err


@pytest.mark.parametrize("engine", [LLM, AsyncLLM], ids=["LLM", "AsyncLLM"])
def test_a_bad_log_level_is_refused_before_any_process_starts(
    engine: type[LLM] | type[AsyncLLM],
    llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the socket folder goes
    before = set(children_of(os.getpid()))
    with pytest.raises(ValueError) as info:
        engine(str(llama_dir), log_level="loud", device=CPU)
    assert str(info.value) == (
        "log_level (any case) must be DEBUG or INFO or WARNING or ERROR or CRITICAL, not 'LOUD'"
    )
    assert set(children_of(os.getpid())) <= before, "a process was started"
    assert not list(tmp_path.glob("pagedserve-*")), "an engine's socket folder was made"


@pytest.mark.parametrize(("env", "checked"), [("1", True), (None, False)], ids=["set", "unset"])
def test_pagedserve_check_invariants_reaches_the_core_in_its_config(
    env: str | None,
    checked: bool,
    llama_dir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if env is None:
        monkeypatch.delenv(CHECK_INVARIANTS_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECK_INVARIANTS_ENV, env)
    with LLM(str(llama_dir), log_level="INFO", device=CPU) as llm:
        assert _core_config(llm).check_invariants is checked
        # With the checks on, every step and the idle pool after the last one are walked.
        outs = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length", "length"]
    err = capfd.readouterr().err
    assert (CHECKS_ON in err) is checked, err
    assert "Traceback" not in err, err
