"""enginecore/errors.py: the core's two named failures are ValueErrors, and neither is
taken for the other."""

from __future__ import annotations

import pytest

from enginecore.errors import ConfigError, InvariantViolation


def test_both_failures_are_value_errors_for_the_callers_that_catch_those() -> None:
    for kind in (ConfigError, InvariantViolation):
        with pytest.raises(ValueError, match="the message"):
            raise kind("the message")


def test_a_config_error_is_never_caught_as_a_broken_invariant() -> None:
    assert not issubclass(ConfigError, InvariantViolation)
    assert not issubclass(InvariantViolation, ConfigError)
    with pytest.raises(ConfigError):
        try:
            raise ConfigError("lower --num-gpu-blocks")
        except InvariantViolation:  # pragma: no cover - the test fails if this catches
            pytest.fail("a ConfigError was caught as an InvariantViolation")
