"""launch/output_file.py: the output of `generate` and `run-batch` keeps what was there until
the engine is up, then holds only complete lines, whatever stops the writing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.output_file import JsonLinesOutput, OutputWriteError
from tests.helpers.cli_helpers import ROOT


def test_an_existing_file_is_kept_until_the_engine_is_up(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"yesterday's results\n")
    output = JsonLinesOutput(path)
    assert path.read_bytes() == b"yesterday's results\n"
    output.start()
    output.write(b'{"a":1}')
    assert path.read_bytes() == b'{"a":1}\n'  # on disk at once, before close
    output.close()
    assert output.held() == 1


def test_a_file_made_for_a_run_that_never_started_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "out.jsonl"
    output = JsonLinesOutput(path)
    assert path.exists()  # created at once, folders too: a bad path fails before start-up
    output.close()
    assert not path.exists()


def test_a_full_device_fails_with_one_line_naming_it_and_then_stays_failed() -> None:
    output = JsonLinesOutput(Path("/dev/full"))
    output.start()
    with pytest.raises(OutputWriteError) as failed:
        output.write(b'{"a":1}')
    assert str(failed.value) == (
        "cannot write /dev/full: No space left on device (errno 28); it holds 0 complete results"
    )
    with pytest.raises(OutputWriteError):  # nothing more is attempted
        output.write(b'{"a":2}')
    output.close()


# A process whose files may not grow past 1,000 bytes, as on a disk that fills up: the
# line that crosses the limit is written in part, then the next write fails.
_FILLS_UP = """
import resource, signal, sys
from pathlib import Path
from launch.output_file import JsonLinesOutput, OutputWriteError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
output = JsonLinesOutput(Path(sys.argv[1]))
output.start()
try:
    for i in range(100):
        output.write(b'{"i":%d,"pad":"%s"}' % (i, b"x" * 60))
except OutputWriteError as e:
    print(e)
"""


def test_a_line_cut_by_a_full_disk_is_taken_back(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    said = subprocess.run(
        [sys.executable, "-c", _FILLS_UP, str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        check=True,
    ).stdout
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"", "the file ends with a complete line"
    parsed = [json.loads(x) for x in lines[:-1]]
    assert [x["i"] for x in parsed] == list(range(len(parsed)))
    assert 0 < len(parsed) < 100 and path.stat().st_size <= 1000
    assert f"it holds {len(parsed)} complete results" in said, said
    assert f"cannot write {path}: File too large" in said, said
