"""A process's resident memory, read from /proc (psutil is not a dependency)."""

from __future__ import annotations


def rss_bytes(pid: int) -> int:
    """VmRSS of a live process, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"process {pid} reports no VmRSS")
