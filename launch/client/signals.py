"""Stop signals for a process that runs an engine: SIGTERM and SIGHUP unwind like Ctrl-C, so
start-up and the run stop what they started, in order."""

from __future__ import annotations

import signal


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so the engine shuts down in order."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def install_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    # Explicit: a shell without job control starts background jobs with SIGINT ignored,
    # and Python then never raises KeyboardInterrupt; `kill -INT` must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
