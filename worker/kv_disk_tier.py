"""DiskKVTier: the second KV tier's disk level, one file per slot and rank.

A file holds one block of this rank's shard: a header (magic, fingerprint, slot, the
block's hash and hash input, payload length, crc32 of all that follows it), then the
bytes. Writes run on a thread, off the step's path, and are atomic (tmp + os.replace),
so a file is always a whole, earlier block. At start-up the headers of files whose
fingerprint matches and whose length is whole are indexed; a load reads the payload
straight into its staging row and verifies the hash and the checksum there, so a file
damaged at any time is a miss (recomputed), never wrong KV. A disk that fills up or
refuses writes turns the disk level's writes off with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("pagedserve.worker")

MAGIC = b"PSKVTIER"
# magic, fingerprint (32 bytes), slot, hash length, hash-input length, payload length, crc32
_HEADER = struct.Struct("<8s32sIHIQI")
# Threads a load reads and verifies files on (a few cover a local disk's queue depth).
READ_THREADS = 4


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


class DiskKVTier:
    """This rank's disk level: slot S's block in DIR/rank<r>/slot<S>.kv."""

    def __init__(
        self, directory: str, rank: int, fingerprint: bytes, num_slots: int, block_bytes: int
    ) -> None:
        self.dir = Path(directory) / f"rank{rank}"
        self.fingerprint = fingerprint
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.enabled = True
        self.written_bytes = 0
        self.bad_reads = 0
        self._queue: queue.Queue[tuple[int, bytes, bytes, memoryview] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        # Queued, not yet on disk: a read of such a slot takes these bytes, so a block
        # stored a moment ago loads before its file is written.
        self._pending: dict[int, tuple[bytes, memoryview]] = {}
        self._lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None  # read_many's, started on first use
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
    def restore(self) -> list[tuple[int, bytes, bytes]]:
        """(slot, hash, hash input) of every slot file of this fingerprint and whole
        length; only headers are read (a payload's checksum is verified when it loads).
        Other settings' files and damaged ones are skipped, logged once."""
        restored: list[tuple[int, bytes, bytes]] = []
        other = corrupt = 0
        if not self.dir.is_dir():
            return restored
        for entry in os.scandir(self.dir):
            name = entry.name
            if not (name.startswith("slot") and name.endswith(".kv")):
                continue
            try:
                slot = int(name[4:-3])
            except ValueError:
                continue
            if not 0 <= slot < self.num_slots:
                continue
            try:
                with open(entry.path, "rb") as f:
                    found = self._head(f, slot, os.fstat(f.fileno()).st_size)
            except OSError:
                found = None
            if found is None:
                corrupt += 1
            elif isinstance(found, str):
                other += 1
            else:
                restored.append((slot, found[0], found[1]))
        if other:
            log.warning("KV tier: %d stored block(s) of other settings ignored", other)
        if corrupt:
            log.warning("KV tier: %d stored block(s) corrupt or truncated, ignored", corrupt)
        return sorted(restored)

    def _head(self, f: BinaryIO, slot: int, size: int) -> tuple[bytes, bytes, int] | str | None:
        """(hash, hash input, crc32) from a slot file's header; "other": another
        fingerprint; None: not a whole slot file of this slot."""
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return None
        magic, fp, file_slot, hlen, ilen, plen, crc = _HEADER.unpack(head)
        if magic != MAGIC or file_slot != slot:
            return None
        if fp != self.fingerprint or plen != self.block_bytes:
            return "other"
        if size != _HEADER.size + hlen + ilen + plen:
            return None
        meta = f.read(hlen + ilen)
        if len(meta) != hlen + ilen:
            return None
        return meta[:hlen], meta[hlen:], crc

    # -- loads ------------------------------------------------------------------------
    def read_into(self, slot: int, block_hash: bytes, out: memoryview) -> bool:
        """Slot's block into out (block_bytes), if it holds block_hash and its checksum
        verifies; False otherwise (the caller recomputes it; logged once)."""
        with self._lock:
            pending = self._pending.get(slot)
        if pending is not None:
            if pending[0] != block_hash:
                return self._bad(slot, "holds another block")
            out[:] = pending[1]
            return True
        try:
            with open(self._path(slot), "rb", buffering=0) as f:
                found = self._head(f, slot, os.fstat(f.fileno()).st_size)
                if found is None or isinstance(found, str) or found[0] != block_hash:
                    return self._bad(slot, "holds another block or is damaged")
                n = f.readinto(out)
        except OSError as e:
            return self._bad(slot, str(e))
        _, hash_input, crc = found
        if n != len(out) or zlib.crc32(out, zlib.crc32(block_hash + hash_input)) != crc:
            return self._bad(slot, "fails its checksum")
        return True

    def read_many(
        self, slots: list[int], hashes: list[bytes], rows: list[memoryview]
    ) -> list[bool]:
        """read_into for each (slot, hash, row) on a few threads: reads and crc32 release
        the GIL, so one file is read while another is verified; whether each one loaded."""
        if len(slots) < 2:
            return [self.read_into(*args) for args in zip(slots, hashes, rows, strict=True)]
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-tier-read")
        return list(self._readers.map(self.read_into, slots, hashes, rows))

    def _bad(self, slot: int, why: str) -> bool:
        with self._lock:  # reads run on several threads
            first = not self.bad_reads
            self.bad_reads += 1
        if first:
            log.warning(
                "KV tier: %s %s; such blocks are recomputed (logged once)", self._path(slot), why
            )
        return False

    # -- writes -----------------------------------------------------------------------
    def write(self, slot: int, block_hash: bytes, hash_input: bytes, payload: memoryview) -> None:
        """Queue slot's new content (payload: a copy the step no longer writes)."""
        if not self.enabled or slot >= self.num_slots:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="kv-tier-disk", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending[slot] = (block_hash, payload)
        self._queue.put((slot, block_hash, hash_input, payload))

    def _writer(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.enabled:
                self._write_one(*item)
            with self._lock:
                # A newer store of the slot keeps its own pending bytes.
                if self._pending.get(item[0], (b"", None))[1] is item[3]:
                    del self._pending[item[0]]
            self._queue.task_done()
        self._queue.task_done()

    def _write_one(
        self, slot: int, block_hash: bytes, hash_input: bytes, payload: memoryview
    ) -> None:
        meta = block_hash + hash_input
        header = _HEADER.pack(
            MAGIC,
            self.fingerprint,
            slot,
            len(block_hash),
            len(hash_input),
            len(payload),
            zlib.crc32(payload, zlib.crc32(meta)),
        )
        path = self._path(slot)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(meta)
                f.write(payload)
            os.replace(tmp, path)
            self.written_bytes += len(header) + len(meta) + len(payload)
        except OSError as e:
            self._off(e)
            tmp.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown()
            self._readers = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
