"""protocol/recording.py, on hand-made frames: records come back as written, in order;
the file layout is the documented one; a crashed run's torn tail is dropped while damage
a closed recording vouches for is refused; other versions are refused by name."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgspec
import pytest

from protocol.config import WorkerConfig
from protocol.recording import (
    CONFIGURE,
    FORMAT_VERSION,
    HELLO,
    MAGIC,
    OUTPUT,
    STEP,
    Recorder,
    Recording,
    RecordingError,
)
from protocol.worker import PROTOCOL_VERSION

WORKER = WorkerConfig(
    model="/models/tiny",
    rank=0,
    world_size=1,
    core_address="ipc:///tmp/w",
    block_size=16,
    dtype="auto",
    device="cpu",
    kv_cache_memory=None,
    gpu_memory_utilization=0.9,
    max_num_batched_tokens=64,
    max_num_seqs=4,
    seed=0,
    generation_config="auto",
    log_level="WARNING",
)
RECORDS = [(HELLO, b"hello"), (CONFIGURE, b"cfg"), (STEP, b"step-1"), (OUTPUT, b""), (STEP, b"s2")]


def _record(directory: Path, close: bool = True) -> Path:
    recorder = Recorder(directory, WORKER)
    for kind, payload in RECORDS:
        recorder.write(kind, memoryview(payload))
    if close:
        recorder.close()
        recorder.close()  # a second close changes nothing
    else:
        recorder._file.flush()  # the bytes a crash leaves on disk
    return directory


def test_records_come_back_in_order_with_the_header(tmp_path: Path) -> None:
    recording = Recording(_record(tmp_path / "rec"))
    assert list(recording.records()) == RECORDS
    m = recording.manifest
    assert (m.format_version, m.protocol_version) == (FORMAT_VERSION, PROTOCOL_VERSION)
    assert (m.world_size, m.block_size, m.model, m.worker) == (1, 16, "/models/tiny", WORKER)
    assert m.complete and m.records == {"hello": 1, "configure": 1, "step": 2, "output": 1}
    assert not recording.truncated and recording.end == m.frames_bytes


def test_the_frames_file_is_magic_then_kind_length_crc_payload(tmp_path: Path) -> None:
    data = (_record(tmp_path / "rec") / "frames.bin").read_bytes()
    want = MAGIC + b"".join(
        struct.pack("<BII", kind, len(p), zlib.crc32(p)) + p for kind, p in RECORDS
    )
    assert data == want


def test_a_crashed_run_keeps_every_whole_record(tmp_path: Path) -> None:
    rec = _record(tmp_path / "rec", close=False)
    frames = rec / "frames.bin"
    frames.write_bytes(frames.read_bytes()[:-1])  # the last record torn
    recording = Recording(rec)
    assert not recording.manifest.complete
    assert list(recording.records()) == RECORDS[:-1]
    assert recording.truncated


def test_damage_inside_a_closed_recording_is_refused(tmp_path: Path) -> None:
    rec = _record(tmp_path / "rec")
    frames = rec / "frames.bin"
    data = bytearray(frames.read_bytes())
    data[len(MAGIC) + 9] ^= 0xFF  # the first payload's first byte
    frames.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match=f"damaged at byte {len(MAGIC)}"):
        list(Recording(rec).records())


def test_another_version_is_refused_by_name(tmp_path: Path) -> None:
    rec = _record(tmp_path / "rec")
    manifest = msgspec.json.decode((rec / "manifest.json").read_bytes())
    manifest["format_version"] = FORMAT_VERSION - 1
    (rec / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    with pytest.raises(RecordingError, match=f"recording format {FORMAT_VERSION - 1} and"):
        Recording(rec)


def test_what_is_not_a_recording_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="holds no recording"):
        Recording(tmp_path)
    rec = _record(tmp_path / "rec")
    with pytest.raises(RecordingError, match="already holds a recording"):
        Recorder(rec, WORKER)
    (rec / "frames.bin").write_bytes(b"not ours")
    with pytest.raises(RecordingError, match="is not a pagedserve recording"):
        Recording(rec)
    (rec / "manifest.json").write_bytes(b"[1, 2")
    with pytest.raises(RecordingError, match="is not valid JSON"):
        Recording(rec)
