"""launch/client/version.py: the version /version and --version report is the one
pyproject.toml declares, once the package is installed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib

from launch.client.version import package_version

ROOT = Path(__file__).resolve().parents[3]


def test_the_reported_version_is_the_installed_one_or_unknown() -> None:
    try:
        installed = version("pagedserve")
    except PackageNotFoundError:
        assert package_version() == "unknown"
        return
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert package_version() == installed == declared
