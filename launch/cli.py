"""The `pagedserve` console script."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="pagedserve: a CUDA-free EngineCore that owns the KV cache, plus workers.",
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("generate", help="offline generation (not available yet)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "generate":
        # Say so plainly rather than pretend: the engine lands with the scheduler.
        print(
            "pagedserve generate: the engine does not generate text yet; "
            "for now run `python benchmarks/kv_cache_bench.py --synthetic`",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
