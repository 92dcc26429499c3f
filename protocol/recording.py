"""Recordings of the core<->worker stream: every frame exactly as sent, for bit-exact replay.

A recording is a directory of two files:

    manifest.json   the header and the index, JSON (Manifest below):
                    format_version, protocol_version, world_size, block_size, model and
                    the WorkerConfig the workers were started with; then complete (false
                    until the recorder closed cleanly), frames_bytes (the length of
                    frames.bin known to end on a whole record) and a count per kind.
    frames.bin      MAGIC (8 bytes), then records, append-only:
                    kind u8 | length u32 LE | crc32(payload) u32 LE | payload

Record kinds, in the order the core met them: HELLO (each rank's WorkerHello frame, rank
order), CONFIGURE (the WorkerConfigure frame broadcast), then per step STEP (the
SchedulerOutput frame broadcast to every rank) followed by OUTPUT (rank 0's
ModelRunnerOutput frame) when the step was answered. Payloads are the msgpack bytes of
protocol/worker.py, never re-encoded.

Crash safety: records are flushed and the manifest rewritten (atomically, by rename) at
most once a second and on close. A run that crashed leaves complete=false; a reader then
takes every record whose length and checksum are whole, however far the manifest got.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec

from protocol.config import WorkerConfig
from protocol.worker import PROTOCOL_VERSION

# Bumped on any change to the layout above or to Manifest's fields.
FORMAT_VERSION = 2  # 2: the worker config carries gpu_memory_utilization
MAGIC = b"PSREC\x00\x00\x01"
MANIFEST = "manifest.json"
FRAMES = "frames.bin"

HELLO, CONFIGURE, STEP, OUTPUT = 1, 2, 3, 4
KIND_NAMES = {HELLO: "hello", CONFIGURE: "configure", STEP: "step", OUTPUT: "output"}

_RECORD = struct.Struct("<BII")  # kind, payload length, crc32 of the payload
# Manifest rewrites while recording: often enough that a crash loses little index, rare
# enough to cost nothing per step.
MANIFEST_INTERVAL_S = 1.0


class RecordingError(ValueError):
    """A recording that cannot be read or replayed by this version; the message says why."""


class Manifest(msgspec.Struct, forbid_unknown_fields=True):
    format_version: int
    protocol_version: int
    world_size: int
    block_size: int
    model: str
    # rank 0's start-up settings; replay keeps every setting and gives each rank its own
    # rank, sockets, rendezvous, parent and log level (and the model path if moved)
    worker: WorkerConfig
    complete: bool = False
    frames_bytes: int = 0
    records: dict[str, int] = {}


class Recorder:
    """Appends frames to a new recording directory. Not thread-safe (the core has one)."""

    def __init__(self, directory: str | Path, worker: WorkerConfig) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if (self.dir / MANIFEST).exists() or (self.dir / FRAMES).exists():
                raise RecordingError(
                    f"{self.dir} already holds a recording: record into a new directory"
                )
            self._file = open(self.dir / FRAMES, "wb")  # noqa: SIM115 (closed by close())
            self._file.write(MAGIC)
        except OSError as e:
            raise RecordingError(f"cannot record into {self.dir}: {e.strerror}") from None
        self.manifest = Manifest(
            format_version=FORMAT_VERSION,
            protocol_version=PROTOCOL_VERSION,
            world_size=worker.world_size,
            block_size=worker.block_size,
            model=worker.model,
            worker=worker,
            frames_bytes=len(MAGIC),
            records={name: 0 for name in KIND_NAMES.values()},
        )
        self._bytes = len(MAGIC)
        self._next_sync = 0.0
        self._sync()

    def write(self, kind: int, frame: bytes | memoryview) -> None:
        payload = bytes(frame)
        f = self._file
        f.write(_RECORD.pack(kind, len(payload), zlib.crc32(payload)))
        f.write(payload)
        self._bytes += _RECORD.size + len(payload)
        self.manifest.records[KIND_NAMES[kind]] += 1
        if time.monotonic() >= self._next_sync:
            self._sync()

    def close(self) -> None:
        if self._file.closed:
            return
        self.manifest.complete = True
        self._sync()
        self._file.close()

    def _sync(self) -> None:
        self._file.flush()
        self.manifest.frames_bytes = self._bytes
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(self.manifest), indent=2))
        os.replace(tmp, self.dir / MANIFEST)
        self._next_sync = time.monotonic() + MANIFEST_INTERVAL_S


class Recording:
    """A recording opened for reading: its manifest, and its records in order."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        try:
            self._data = (self.dir / FRAMES).read_bytes()
        except OSError as e:
            raise RecordingError(f"cannot read {self.dir / FRAMES}: {e.strerror}") from None
        if not self._data.startswith(MAGIC):
            raise RecordingError(f"{self.dir / FRAMES} is not a pagedserve recording")
        # Set by records(): where the last whole record ends, and whether bytes follow it.
        self.end = len(MAGIC)
        self.truncated = False

    def records(self) -> Iterator[tuple[int, bytes]]:
        """(kind, payload) of every whole record, in order. A torn tail (a crashed run) is
        dropped; damage inside what a cleanly closed recording vouches for is an error."""
        data, offset = self._data, len(MAGIC)
        while offset < len(data):
            torn = offset + _RECORD.size > len(data)
            if not torn:
                kind, length, crc = _RECORD.unpack_from(data, offset)
                start = offset + _RECORD.size
                payload = data[start : start + length]
                torn = len(payload) != length or zlib.crc32(payload) != crc
                torn = torn or kind not in KIND_NAMES
            if torn:
                if self.manifest.complete and offset < self.manifest.frames_bytes:
                    raise RecordingError(
                        f"{self.dir / FRAMES} is damaged at byte {offset} (a record's length "
                        "or checksum is wrong)"
                    )
                self.truncated = True
                return
            offset = start + length
            self.end = offset
            yield kind, payload


def read_manifest(directory: Path) -> Manifest:
    """The manifest, refused by name if another format or protocol version wrote it."""
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecordingError(f"{directory} holds no recording ({MANIFEST} is missing)") from None
    except OSError as e:
        raise RecordingError(f"cannot read {path}: {e.strerror}") from None
    try:
        loose = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RecordingError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(loose, dict):
        raise RecordingError(f"{path} is not a recording manifest")
    # Versions first: an older manifest may not even have today's fields.
    fmt, proto = loose.get("format_version"), loose.get("protocol_version")
    if fmt != FORMAT_VERSION or proto != PROTOCOL_VERSION:
        raise RecordingError(
            f"{directory} was recorded with recording format {fmt} and worker protocol "
            f"{proto}; this pagedserve reads format {FORMAT_VERSION} and speaks protocol "
            f"{PROTOCOL_VERSION}: replay it with the pagedserve version that recorded it"
        )
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as e:
        raise RecordingError(f"{path}: {e}") from None
