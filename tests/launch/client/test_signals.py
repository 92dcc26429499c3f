"""launch/client/signals.py: SIGTERM and SIGHUP raise Terminated, which `except Exception`
does not swallow, and SIGINT is Ctrl-C again even where it was ignored."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from launch.client.signals import (
    Terminated,
    hurried,
    install_signal_handlers,
    restore_handlers,
    stop_signals_deferred,
)

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell without job control starts us
    try:
        install_signal_handlers()
        yield
    finally:
        restore_handlers(saved)  # and forget a hurry, for the tests that follow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_unwinds_past_except_exception(handlers: None, sig: int) -> None:
    with pytest.raises(Terminated) as info:
        try:
            signal.raise_signal(sig)
        except Exception:  # what a library's broad handler would do
            pytest.fail("Terminated was caught as an Exception")
    assert info.value.signum == sig


def test_sigint_raises_keyboard_interrupt_even_after_it_was_ignored(handlers: None) -> None:
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_second_stop_signal_only_hurries_the_shutdown(handlers: None) -> None:
    with pytest.raises(Terminated):
        signal.raise_signal(signal.SIGTERM)
    assert not hurried()
    for sig in SIGNALS:  # while the first one's shutdown runs: nothing raises
        signal.raise_signal(sig)
    assert hurried()


def test_a_shutdown_defers_stop_signals_and_gives_back_other_handlers() -> None:
    seen: list[int] = []
    saved = signal.signal(signal.SIGTERM, lambda sig, _frame: seen.append(sig))
    try:
        with stop_signals_deferred():
            signal.raise_signal(signal.SIGTERM)  # would raise in a command: hurries here
            assert hurried()
        assert seen == [] and not hurried()
        signal.raise_signal(signal.SIGTERM)  # the program's own handler is back
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, saved)
