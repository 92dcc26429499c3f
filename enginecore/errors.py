"""The core's two kinds of expected failure, apart from a lost worker (WorkerDied).

ConfigError: the engine cannot start as asked (a flag, the memory, an address); one line
for the user. Anything else raised in the core is a bug and is reported with its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """The engine cannot start with this configuration; the message says what to change."""
