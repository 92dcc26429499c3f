"""The core's kinds of failure, apart from a lost worker (WorkerDied).

ConfigError: the engine cannot start as asked (a flag, the memory, an address); one line
for the user. InvariantViolation: the KV-cache bookkeeping was asked to break one of its
rules (a block freed twice, a request that holds no blocks); a bug in the core, never the
fault of a request or a worker's answer. Anything else raised in the core is a bug too;
all are reported with their traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """The engine cannot start with this configuration; the message says what to change."""


class InvariantViolation(ValueError):
    """A KV-cache consistency rule would break; nothing was changed. A ValueError for the
    pool's own callers and tests, but the core never reports it as a bad request or a
    worker's wrong answer."""
