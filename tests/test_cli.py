"""The console script is installed and answers plainly."""

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, check=False
    )


def test_version_names_the_distribution() -> None:
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("pagedserve ")


def test_no_command_prints_usage_and_fails() -> None:
    out = _run()
    assert out.returncode == 2
    assert "usage: pagedserve" in out.stderr
