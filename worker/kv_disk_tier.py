"""DiskKVTier: the host tier's slots persisted to local disk, one file per slot and rank.

A file holds one block of this rank's shard: a header (magic, fingerprint, slot, the
block's hash and hash input, payload length, crc32 of all that follows it), then the
bytes. Writes run on a thread, off the step's path, and are atomic (tmp + os.replace),
so a file is always a whole, earlier block. At start-up every file whose fingerprint
matches and whose checksum verifies is read back into its host slot; anything else is
a miss. A disk that fills up or refuses writes turns persistence off with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pagedserve.worker")

MAGIC = b"PSKVTIER"
# magic, fingerprint (32 bytes), slot, hash length, hash-input length, payload length, crc32
_HEADER = struct.Struct("<8s32sIHIQI")


def fingerprint(model_dir: str, *parts: object) -> bytes:
    """What must match for a stored block to be usable: the model (its config.json, and
    each weight file's name, size and last 64 KiB: other weights, other bytes), and the
    parts (dtype, layout, block size, rank and TP size, the core's hash digest)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=32)
    root = Path(model_dir)
    h.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            f.seek(max(0, size - 65536))
            h.update(f.read())
    return h.digest()


def _read(path: Path) -> bytearray:
    """The whole file, read into one writable buffer (the payload is copied once more,
    into its host slot, without an intermediate bytes object)."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        n = f.readinto(data)
    return data[:n] if n != len(data) else data


class DiskKVTier:
    def __init__(
        self, directory: str, rank: int, fingerprint: bytes, num_slots: int, block_bytes: int
    ) -> None:
        self.dir = Path(directory) / f"rank{rank}"
        self.fingerprint = fingerprint
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.enabled = True
        self.written_bytes = 0
        self._queue: queue.Queue[tuple[int, bytes, bytes, bytes] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._off(e)

    def _off(self, error: OSError) -> None:
        if self.enabled:
            log.warning("KV tier: writing %s failed (%s); the disk tier is off", self.dir, error)
        self.enabled = False

    def _path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.kv"

    # -- start-up ---------------------------------------------------------------------
    def restore(self, put: Callable[[int, memoryview], None]) -> list[tuple[int, bytes, bytes]]:
        """Read every usable slot file back (put(slot, payload)); (slot, hash, hash input)
        of each. Other settings' files and corrupt ones are skipped, logged once."""
        restored: list[tuple[int, bytes, bytes]] = []
        other = corrupt = 0
        if not self.dir.is_dir():
            return restored
        for slot in range(self.num_slots):
            try:
                data = _read(self._path(slot))
            except FileNotFoundError:
                continue
            except OSError:
                corrupt += 1
                continue
            entry = self._parse(slot, data)
            if entry is None:
                corrupt += 1
            elif entry == "other":
                other += 1
            else:
                block_hash, hash_input, payload = entry
                put(slot, payload)
                restored.append((slot, block_hash, hash_input))
        if other:
            log.warning("KV tier: %d stored block(s) of other settings ignored", other)
        if corrupt:
            log.warning("KV tier: %d stored block(s) corrupt or truncated, ignored", corrupt)
        return restored

    def _parse(self, slot: int, data: bytearray) -> tuple[bytes, bytes, memoryview] | str | None:
        if len(data) < _HEADER.size:
            return None
        magic, fp, file_slot, hlen, ilen, plen, crc = _HEADER.unpack_from(data)
        if magic != MAGIC or file_slot != slot:
            return None
        if fp != self.fingerprint or plen != self.block_bytes:
            return "other"
        body = memoryview(data)[_HEADER.size :]
        if len(body) != hlen + ilen + plen or zlib.crc32(body) != crc:
            return None
        return bytes(body[:hlen]), bytes(body[hlen : hlen + ilen]), body[hlen + ilen :]

    # -- writes -----------------------------------------------------------------------
    def write(self, slot: int, block_hash: bytes, hash_input: bytes, payload: bytes) -> None:
        """Queue slot's new content (payload copied already: the slot may change)."""
        if not self.enabled or slot >= self.num_slots:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="kv-tier-disk", daemon=True)
            self._thread.start()
        self._queue.put((slot, block_hash, hash_input, payload))

    def _writer(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.enabled:
                self._write_one(*item)
            self._queue.task_done()
        self._queue.task_done()

    def _write_one(self, slot: int, block_hash: bytes, hash_input: bytes, payload: bytes) -> None:
        body = block_hash + hash_input + payload
        header = _HEADER.pack(
            MAGIC,
            self.fingerprint,
            slot,
            len(block_hash),
            len(hash_input),
            len(payload),
            zlib.crc32(body),
        )
        path = self._path(slot)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(body)
            os.replace(tmp, path)
            self.written_bytes += len(header) + len(body)
        except OSError as e:
            self._off(e)
            tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
