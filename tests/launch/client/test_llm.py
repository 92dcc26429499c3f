"""Every input from outside is checked where it enters, with a clear error, and a bad one
fails alone: the Python API's arguments, raw frames a client sends the core, token ids
too large for any codec, memory sizes no machine has."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from launch import LLM, SamplingParams
from launch.client.engine_processes import EngineDeadError
from tests.helpers.cli_helpers import CPU, generate_cli

OK = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path):
    with LLM(str(llama_dir), device=CPU) as engine:
        yield engine


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (SamplingParams(max_tokens=8.0), TypeError, "Expected `int`, got `float`"),  # type: ignore[arg-type]
        (SamplingParams(max_tokens="4"), TypeError, "Expected `int`, got `str`"),  # type: ignore[arg-type]
        ({"max_tokens": 4}, TypeError, "must be a SamplingParams, got dict"),
        (SamplingParams(stop_token_ids=[2**64]), ValueError, "stop token id 18446744073709551616"),
        ([OK], ValueError, "1 sampling params for 2 prompts"),
    ],
)
def test_bad_arguments_raise_before_anything_is_sent(
    llm: LLM, params: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(")):
        llm.generate([[5, 6], [7, 8]], params, use_tqdm=False)  # type: ignore[arg-type]
    # Nothing was left half-sent: the engine still serves.
    (out,) = llm.generate([[5, 6]], OK, use_tqdm=False)
    assert out.finish_reason == "length"


def test_prompts_and_params_in_every_form(llm: LLM) -> None:
    one = llm.generate([9, 10, 11], OK, use_tqdm=False)  # token ids: one prompt
    assert len(one) == 1 and one[0].prompt_token_ids == [9, 10, 11]
    (text,) = llm.generate("Hello", OK, use_tqdm=False)  # one prompt, not five
    assert text.finish_reason == "error" and "no tokenizer.json" in (text.error or "")
    per_prompt = llm.generate(
        [[9, 10], [9, 11]],
        [OK, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in per_prompt] == [3, 2]
    finished: list[int] = []
    llm.generate([[1, 2], [3, 4]], OK, use_tqdm=False, on_finish=lambda o: finished.append(o.index))
    assert sorted(finished) == [0, 1]


def test_a_token_id_beyond_any_codec_fails_its_prompt_alone(llm: LLM) -> None:
    outs = llm.generate([[5, 2**64], [5, 6], [5, "x"]], OK, use_tqdm=False)  # type: ignore[list-item]
    assert [o.finish_reason for o in outs] == ["error", "length", "error"]
    assert "prompt 0: token id 18446744073709551616 is outside the vocabulary" in outs[0].error
    assert "prompt 2: prompt_token_ids holds 'x', not an int" in outs[2].error


def test_a_malformed_request_frame_is_answered_not_dropped(llm: LLM) -> None:
    # What a client that bypasses the Python API (another language, a bug) might send.
    frame = msgspec.msgpack.encode(
        {"type": "add", "request_id": "raw-1", "prompt_token_ids": [5, 6], "sampling_params": 7}
    )
    llm.engine.to_core.send(frame)
    while True:
        batch = llm.engine.get_outputs()
        if batch is not None and batch.outputs:
            break
    (out,) = batch.outputs
    assert out.request_id == "raw-1" and out.finish_reason == "error"
    assert "malformed frame on the client->core channel" in (out.error or "")
    (after,) = llm.generate([[5, 6]], OK, use_tqdm=False)
    assert after.finish_reason == "length"


def test_generate_after_close_says_so(llama_dir: Path) -> None:
    engine = LLM(str(llama_dir), device=CPU)
    engine.close()
    with pytest.raises(EngineDeadError, match="closed"):
        engine.generate([[5, 6]], OK)


def test_token_ids_too_large_in_input_lines_fail_alone(llama_dir: Path, tmp_path: Path) -> None:
    lines = [
        json.dumps({"prompt_token_ids": [5, 2**64], "max_tokens": 2}),
        json.dumps({"prompt_token_ids": [5, 2**63], "max_tokens": 2}),
        json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2, "stop_token_ids": [2**63]}),
        json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2}),
    ]
    proc, results = generate_cli(llama_dir, lines, tmp_path)
    assert proc.returncode == 1 and "3 of 4 requests failed" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert [r["finish_reason"] for r in results] == ["error", "error", "error", "length"]
