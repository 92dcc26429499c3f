"""Stop signals for a process that runs an engine: SIGTERM and SIGHUP unwind like Ctrl-C, so
start-up and the run stop what they started, in order. Only the first stop signal unwinds:
from then on (and while an engine shuts down) a stop signal only hurries the shutdown, since
an exception raised in the middle of stopping would leave processes and files behind."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# What signal.signal returns: a function, SIG_DFL/SIG_IGN, or None (set outside Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

_hurried = threading.Event()  # a stop signal came while stopping


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so the engine shuts down in order."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    _defer_all()
    raise Terminated(signum)


def _on_interrupt(_signum: int, _frame: FrameType | None) -> None:
    _defer_all()
    raise KeyboardInterrupt


def _on_late_signal(_signum: int, _frame: FrameType | None) -> None:
    _hurried.set()


def install_signal_handlers() -> None:
    """For a command's process: the first stop signal unwinds, later ones hurry."""
    _hurried.clear()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    # Explicit: a shell without job control starts background jobs with SIGINT ignored,
    # and Python then never raises KeyboardInterrupt; `kill -INT` must still stop us.
    signal.signal(signal.SIGINT, _on_interrupt)


def _defer_all() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_late_signal)


def hurried() -> bool:
    """Whether a stop signal came while stopping: stop the children now, not gracefully."""
    return _hurried.is_set()


def hurry() -> None:
    """What a later stop signal does, for handlers that are not this module's."""
    _hurried.set()


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Within: a stop signal hurries instead of raising. Only the main thread can set
    handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_late_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        restore_handlers(previous)


def restore_handlers(previous: dict[int, Handler]) -> None:
    """Put back handlers saved before a capture. A command's own (install_signal_handlers)
    come back deferred: once it has stopped an engine, the command is ending. A program's
    own come back as they were, and a later shutdown starts unhurried."""
    for sig, handler in previous.items():
        if handler in (_on_signal, _on_interrupt, _on_late_signal):
            signal.signal(sig, _on_late_signal)
        elif handler is not None:
            signal.signal(sig, handler)
            _hurried.clear()
