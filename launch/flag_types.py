"""argparse value types shared by the command-line flags: each parses one flag's text and
fails with an error that names the flag."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec


def string_list(value: str) -> list[str]:
    """A list flag: a JSON list of strings, or comma-separated values."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = msgspec.json.decode(text, type=list[str])
        except msgspec.DecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {e}") from None
    else:
        items = [x.strip() for x in text.split(",")]
    if not items or not all(items):
        raise argparse.ArgumentTypeError(f"an empty entry in {value!r}")
    return items


_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_bytes(name: str):
    """A byte count: an integer, or a number with a unit (KB, MB, GB, TB: powers of 1000;
    KiB, MiB, GiB, TiB: powers of 1024). A bare K, M, G or T is refused: whether it meant
    1000s or 1024s is the reader's guess."""

    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        if m is None or m.group(2).upper() not in _BYTE_UNITS:
            hint = ""
            if m is not None and m.group(2).upper() in ("K", "M", "G", "T"):
                number, unit = m.group(1), m.group(2).upper()
                hint = f" ({number}{unit}iB for powers of 1024, {number}{unit}B for 1000?)"
            raise argparse.ArgumentTypeError(
                f"{name} must be a byte count such as 268435456, 256MiB or 4GiB, got {text!r}{hint}"
            )
        number, unit = m.group(1), m.group(2).upper()
        value = float(number) * _BYTE_UNITS[unit]
        if value < 1 or (_BYTE_UNITS[unit] == 1 and "." in number):
            raise argparse.ArgumentTypeError(
                f"{name} must be a whole number of bytes >= 1, got {text!r}"
            )
        return int(value)

    return parse


def ranged(name: str, kind: type[int] | type[float], ok: Callable[[Any], bool], rule: str):
    """An argparse type: text read as kind, then checked by ok; errors name the flag."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{name} must be {rule}, got {text}")
        return value

    return parse


def positive(name: str):
    return ranged(name, int, lambda v: v >= 1, ">= 1")


def fraction(name: str):
    return ranged(name, float, lambda v: 0 < v <= 1, "in (0, 1]")


def seconds(name: str) -> Callable[[str], float]:
    return ranged(name, float, lambda s: 0 < s < math.inf, "a number of seconds > 0")
