"""launch/cli_flags.py: the command line's flags parsed in process. Flags left out give
exactly EngineArgs' own defaults; value parsers refuse bad text naming the flag (the
console script's exit status and messages are in test_cli.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from launch.cli_flags import build_parser, engine_kwargs, parse_bytes
from launch.client.engine_args import EngineArgs

ENGINE_COMMANDS = [
    ["generate", "--input", "in.jsonl", "--output", "out.jsonl"],
    ["serve"],
    ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"],
]


@pytest.mark.parametrize("argv", ENGINE_COMMANDS, ids=lambda a: a[0])
def test_flags_left_out_give_engine_args_own_defaults(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert {k: defaults[k] for k in kwargs} == kwargs


def test_engine_flags_reach_their_engine_args_fields() -> None:
    argv = [*ENGINE_COMMANDS[0], "--block-size", "32", "--no-prefix-caching"]
    argv += ["--kv-cache-memory", "1GiB", "--worker-timeout", "12.5"]
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs["block_size"] == 32 and kwargs["enable_prefix_caching"] is False
    assert kwargs["kv_cache_memory"] == 1 << 30 and kwargs["startup_timeout_s"] == 12.5
    EngineArgs(model="m", **kwargs).validate()


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("https://a.example,https://b.example", ["https://a.example", "https://b.example"]),
        (' ["GET", "POST"] ', ["GET", "POST"]),
        ("*", ["*"]),
    ],
)
def test_a_list_flag_takes_commas_or_a_json_list(value: str, parsed: list[str]) -> None:
    args = build_parser().parse_args(["serve", "--allowed-origins", value])
    assert args.allowed_origins == parsed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--allowed-origins", "a,,b"], "an empty entry in 'a,,b'"),
        (["serve", "--allowed-origins", "[1]"], "not a JSON list of strings"),
        (["serve", "--port", "http"], "--port must be an integer, got 'http'"),
        (["serve", "--port", "-1"], "--port must be in [0, 65535], got -1"),
        (["generate", "--input", "i", "--output", "o", "--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4G", "(4GiB for powers of 1024, 4GB for 1000?)"),
        ("1.5", "whole number of bytes"),
        ("0.0005KB", "whole number of bytes >= 1"),
        ("12 parsecs", "such as 268435456, 256MiB or 4GiB"),
    ],
)
def test_a_byte_count_that_is_no_whole_count_of_known_units_is_refused(
    text: str, message: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--kv") as info:
        parse_bytes("--kv")(text)
    assert message in str(info.value)


def test_a_fractional_byte_count_in_a_unit_is_rounded_down_to_whole_bytes() -> None:
    assert parse_bytes("--kv")("1.5KB") == 1500
    assert parse_bytes("--kv")("0.0015KiB") == 1  # 1.536 bytes
