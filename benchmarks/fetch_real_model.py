#!/usr/bin/env python3
"""Fetch and convert the real model the tests use (SmolLM2-135M-Instruct) and print its
checkpoint directory on stdout (progress goes to stderr):

    python benchmarks/fetch_real_model.py [--cache-dir DIR]
    pagedserve generate --model "$(python benchmarks/fetch_real_model.py)" ...

The cache defaults to $PAGEDSERVE_REAL_MODEL_CACHE or ~/.cache/pagedserve/real-models/;
see tests/helpers/real_model.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.real_model import RealModelError, fetch_real_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="where converted checkpoints live")
    args = parser.parse_args()
    try:
        path = fetch_real_model(args.cache_dir)
    except RealModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
