"""Keeping Python's cyclic collector off a serving process's start-up heap.

Every process of ours builds a large heap once (a worker's model and tokenizer modules,
the server's app and tokenizer) and then allocates short-lived objects per step. A full
collection walks the whole heap: in a worker holding a model it paused a step for tens to
hundreds of milliseconds, a gap between two tokens many times a decode step's. Objects
alive once start-up is done live as long as the process, so they are moved out of the
collector's sight (gc.freeze); what the steps allocate is still collected as before.

Only our own processes call this (worker, core, API server, `generate` / `run-batch`),
never a library user's process that embeds `LLM`: frozen objects are never freed.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt everything still alive from later collections."""
    gc.collect()
    gc.freeze()
