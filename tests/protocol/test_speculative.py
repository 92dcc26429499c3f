"""--speculative-config: vLLM's keys decoded and checked with errors naming the key; the
step frames carry drafts and accepted tokens only when there are some (a step without
them encodes exactly as before the fields existed)."""

from __future__ import annotations

import msgspec
import pytest

from launch.cli_flags import build_parser, engine_kwargs
from launch.client.engine_args import EngineArgs
from protocol.speculative import SpeculativeConfig, parse_speculative_config
from protocol.worker import CachedRequestData, ModelRunnerOutput, SchedulerOutput

GENERATE = ["generate", "--model", "m", "--input", "in.jsonl", "--output", "out.jsonl"]


def test_vllms_keys_are_read_and_the_lookup_bounds_default_like_vllm() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (config.num_speculative_tokens, config.lookup_min, config.lookup_max) == (4, 3, 3)
    suffix = parse_speculative_config('{"method": "suffix", "num_speculative_tokens": 8}')
    assert suffix.method == "suffix" and suffix.suffix_decoding_max_tree_depth == 24


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"in \[1, 32\]"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "draft_model"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "must not exceed",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 2, '
            '"suffix_decoding_max_spec_factor": 0}',
            "> 0",
        ),
    ],
)
def test_a_bad_config_is_refused_naming_the_flag_and_the_key(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=f"--speculative-config: .*{error}"):
        parse_speculative_config(text)


def test_the_flag_reaches_engine_args_as_a_config() -> None:
    args = build_parser().parse_args(
        [*GENERATE, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    engine = EngineArgs(model="m", **engine_kwargs(args))
    assert engine.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert EngineArgs(model="m").speculative_config is None
    with pytest.raises(ValueError, match="speculative_config must be a JSON object"):
        EngineArgs(model="m", speculative_config=3)  # type: ignore[arg-type]


def test_frames_without_drafts_carry_one_empty_byte_each() -> None:
    """msgspec writes every field of an array-like struct: the new fields cost one byte
    each (an empty map, an empty list) when there are no drafts."""
    so = SchedulerOutput(
        1, [], CachedRequestData(["a"], [None], [5], [False], [None]), [1], 1, [], []
    )
    wire = msgspec.msgpack.encode(so)
    assert wire.endswith(b"\x90\x90\x80")  # finished, preempted, then no drafts
    out = msgspec.msgpack.encode(ModelRunnerOutput(1, ["a"], [7]))
    assert msgspec.msgpack.decode(out)[-1] == []
    drafted = msgspec.structs.replace(so, spec_token_ids={"a": [3, 4]})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(drafted), type=SchedulerOutput)
    assert back.spec_token_ids == {"a": [3, 4]}
