"""The JSON-lines output file of `generate` and `run-batch`: no finished result is ever lost.

The path is opened before the engine starts (a path that cannot be written fails at once)
but not truncated until `start()`, once the engine is up: a failed start-up leaves an
existing file as it was. Each line is then appended with one os-level write the moment its
result exists, so SIGTERM, Ctrl-C or SIGKILL at any point leave every finished result in the
file as a complete line. A write that fails (full disk, I/O error, closed pipe) is cut back
to the last complete line and raises `OutputWriteError`, which names the file and how many
results it holds. A run that ends normally may rewrite the file sorted (input order),
atomically. `-` is standard output (lines as they come; nothing to cut back or sort).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

STDOUT = "-"


class OutputWriteError(Exception):
    """The output cannot take another line; the message is the one line a command prints."""


class JsonLinesOutput:
    def __init__(self, path: Path) -> None:
        """Open path for appending (created if missing, parents too) without touching what
        it holds; OSError when it cannot be written."""
        self.path = path
        self.to_stdout = str(path) == STDOUT
        self.lines = 0  # complete lines written since start()
        self.started = False
        self._created = False
        self._failed: OutputWriteError | None = None
        if self.to_stdout:
            self._fd = sys.stdout.fileno()
            self.regular = False
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            self._created = True
        except FileExistsError:
            self._fd = os.open(path, flags)
        self.regular = stat.S_ISREG(os.fstat(self._fd).st_mode)

    @property
    def name(self) -> str:
        return "standard output" if self.to_stdout else str(self.path)

    def start(self) -> None:
        """The engine is up: empty the file (a regular one) and take lines from now on."""
        if self.regular:
            os.ftruncate(self._fd, 0)
        self.started = True

    def write(self, line: bytes) -> None:
        """Append line (one JSON value, no newline) whole, or raise OutputWriteError with
        the file holding only the lines before it."""
        if self._failed is not None:
            raise self._failed
        assert self.started, "JsonLinesOutput.write before start()"
        data = line + b"\n"
        done = 0
        try:
            while done < len(data):  # a short write (a disk filling up) is retried once
                n = os.write(self._fd, data[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as e:
            self._fail(e, done)
        self.lines += 1

    def _fail(self, error: OSError, partial: int) -> None:
        if partial and self.regular:
            try:  # O_APPEND: the file ends with the cut line, so drop its bytes
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - partial)
            except OSError:
                pass
        reason = error.strerror or str(error)
        self._failed = OutputWriteError(
            f"cannot write {self.name}: {reason} (errno {error.errno}); it holds "
            f"{self.held()} complete results"
        )
        raise self._failed from None

    def held(self) -> int:
        """Complete lines in the output now. For a regular file they are counted in the file
        itself, so a signal between a write and its count cannot make the figure wrong."""
        if not self.regular or not self.started:
            return self.lines
        count = 0
        try:
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 20):
                    count += chunk.count(b"\n")
        except OSError:  # a file that cannot be read back: the lines this object wrote
            return self.lines
        return count

    def close(self, order: Callable[[int, bytes], Any] | None = None) -> None:
        """Close the file; one this object created and never started is removed again.
        order: a sort key of each line (its position in the file, its bytes): a started
        regular file is rewritten in that order, atomically (a crash mid-rewrite leaves the
        file as written); OutputWriteError, the file unchanged, when that cannot be done."""
        if self._fd < 0:
            return
        if not self.to_stdout:
            os.close(self._fd)
            if self._created and not self.started:
                self.path.unlink(missing_ok=True)
        self._fd = -1
        if order is not None and self.started and self.regular and self._failed is None:
            self._rewrite(order)

    def _rewrite(self, order: Callable[[int, bytes], Any]) -> None:
        lines = self.path.read_bytes().splitlines()
        ranked = sorted(range(len(lines)), key=lambda i: order(i, lines[i]))
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for i in ranked:
                    f.write(lines[i] + b"\n")
        except BaseException as e:  # a signal too: the file stays whole, the copy goes
            tmp.unlink(missing_ok=True)
            if not isinstance(e, OSError):
                raise
            raise OutputWriteError(
                f"cannot put {self.path} in input order: {e.strerror or e} (errno {e.errno}); "
                f"it holds {len(lines)} complete results, in the order they finished"
            ) from None
        os.replace(tmp, self.path)
