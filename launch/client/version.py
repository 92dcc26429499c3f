"""The installed package's version, as /version and --version report it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"
