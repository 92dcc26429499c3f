"""worker/step_hooks.py: the base hooks do nothing, and FILE.py:FUNCTION loads a
benchmark's hooks, called with the runner, or fails naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.step_hooks import StepHooks, load_step_hooks

INSTALL = """
from worker.step_hooks import StepHooks

class Counting(StepHooks):
    def __init__(self, runner):
        self.runner = runner

def install(runner):
    runner.touched = True
    return Counting(runner)
"""


class FakeRunner:
    touched = False


def test_the_base_hooks_do_nothing_and_leave_timing_to_the_device() -> None:
    hooks = StepHooks()
    hooks.planning()
    hooks.launch_begin()
    hooks.launch_end()
    hooks.sync()
    hooks.collected()
    hooks.answered(True)
    hooks.close()
    assert hooks.time_left() is None


def test_a_hooks_file_is_called_with_the_runner_and_its_hooks_returned(tmp_path: Path) -> None:
    path = tmp_path / "bench_hooks.py"
    path.write_text(INSTALL)
    runner = FakeRunner()
    hooks = load_step_hooks(f"{path}:install", runner)  # type: ignore[arg-type]
    assert isinstance(hooks, StepHooks) and hooks.runner is runner  # type: ignore[attr-defined]
    assert runner.touched


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hooks.py", "are not FILE.py:FUNCTION"),
        ("hooks.txt:install", "are not FILE.py:FUNCTION"),
        ("hooks.py:", "are not FILE.py:FUNCTION"),
        ("{dir}/bench_hooks.py:missing", "has no 'missing'"),
    ],
)
def test_a_bad_spec_is_refused_by_name(tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "bench_hooks.py").write_text(INSTALL)
    with pytest.raises(ValueError, match=message):
        load_step_hooks(spec.format(dir=tmp_path), FakeRunner())  # type: ignore[arg-type]
