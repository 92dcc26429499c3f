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


def test_flags_out_of_range_are_refused_by_name() -> None:
    """Refused (exit 2, one line naming the flag) before any process starts."""
    cases = [
        (("serve", "--port", "99999"), "--port must be in [0, 65535], got 99999"),
        (("serve", "--gpu-memory-utilization", "0"), "must be in (0, 1], got 0"),
        (("worker", "--gpu-memory-utilization", "1.5"), "must be in (0, 1], got 1.5"),
        (("serve", "--kv-cache-memory", "4G"), "4GiB for powers of 1024, 4GB for 1000?"),
        (("serve", "--kv-cache-memory", "0"), "whole number of bytes >= 1, got '0'"),
        (("serve", "--api-key", " "), "--api-key is empty (unset it for no key)"),
    ]
    for args, message in cases:
        out = _run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_byte_counts_take_units_of_1000_and_1024() -> None:
    from launch.cli_flags import parse_bytes

    parse = parse_bytes("--kv-cache-memory")
    assert parse("268435456") == parse("256MiB") == parse("256 mib") == 256 << 20
    assert parse("1.5GiB") == 3 << 29
    assert parse("2GB") == 2 * 10**9 and parse("64KB") == 64_000
