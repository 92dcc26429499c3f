"""The one point where a benchmark instruments a worker: StepHooks, told of each step's
moments, and the loader of WorkerConfig.step_hooks. The worker runs no hook unless its
config names one; the instruments themselves live with the benchmarks."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner


class StepHooks:
    """Called by the runner and the worker loop at a step's moments; each does nothing
    here. A subclass may model a device (time_left, sync) or time the host thread."""

    def planning(self) -> None:
        """The host starts planning a step that runs tokens."""

    def launch_begin(self) -> None:
        """A step's forward is about to be queued."""

    def launch_end(self) -> None:
        """The step's forward and sampling are queued (on the CPU: have run)."""

    def time_left(self) -> float | None:
        """Seconds until the launched step's tokens are ready; None: ask the device."""
        return None

    def sync(self) -> None:
        """Before the launched step's tokens are read."""

    def collected(self) -> None:
        """The step's tokens are recorded in the batch."""

    def answered(self, more_planned: bool) -> None:
        """The step's answer went to the core; more_planned: the next step is planned."""

    def close(self) -> None:
        """The worker stops serving."""


def load_step_hooks(spec: str, runner: ModelRunner) -> StepHooks | None:
    """Call FUNCTION of FILE.py (spec "FILE.py:FUNCTION") with the runner; it may change
    the runner (a benchmark's forward skips) and returns the hooks to call, or None."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise ValueError(f"step hooks {spec!r} are not FILE.py:FUNCTION")
    module_spec = importlib.util.spec_from_file_location("pagedserve_step_hooks", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"step hooks: cannot load {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    install = getattr(module, name, None)
    if install is None:
        raise ValueError(f"step hooks: {path!r} has no {name!r}")
    return install(runner)
