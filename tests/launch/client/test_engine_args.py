"""EngineArgs: every engine setting is checked before any process starts, naming the
setting and what it may be."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launch.client.engine_args import EngineArgs
from tests.helpers.cli_helpers import generate_cli


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--num-gpu-blocks", str(10**9)), "lower --num-gpu-blocks"),
        (("--kv-cache-memory", str(10**15)), "is available host memory: lower --kv-cache-memory"),
    ],
)
def test_memory_no_machine_has_is_refused_with_numbers(
    flags: tuple[str, ...], message: str, llama_dir: Path, tmp_path: Path
) -> None:
    proc, _ = generate_cli(llama_dir, [json.dumps({"prompt_token_ids": [5]})], tmp_path, *flags)
    assert proc.returncode == 1
    assert message in proc.stderr and "GiB" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "fp8", "dtype must be auto or float32 or float16 or bfloat16, not 'fp8'"),
        ("hash_algo", "md5", "hash_algo must be xxh3_128 or sha256, not 'md5'"),
        ("generation_config", "yes", "generation_config must be auto or none, not 'yes'"),
    ],
)
def test_engine_choices_are_checked_against_their_types(field: str, value: str, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(model="unused", **{field: value}).validate()


def test_a_disk_kv_tier_needs_no_host_memory_but_needs_prefix_caching() -> None:
    EngineArgs(model="m", kv_cache_dir="/tmp/kv").validate()  # the disk level alone
    with pytest.raises(ValueError, match="a KV tier keeps prefix-cache blocks"):
        EngineArgs(model="m", kv_cache_dir="/tmp/kv", enable_prefix_caching=False).validate()
