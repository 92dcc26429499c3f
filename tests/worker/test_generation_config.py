"""worker/generation_config.py: a model's generation_config.json read strictly into EOS ids
and sampling defaults; a malformed field fails naming the file and the field (how the
defaults reach requests is in test_model_files.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from protocol.engine import SamplingDefaults
from worker.generation_config import load_generation_config


def test_generation_config_parsing(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(
        json.dumps({"eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "min_p": 0.1})
    )
    eos, defaults = load_generation_config(tmp_path)
    assert eos == (128001, 128008, 128009)
    assert defaults == SamplingDefaults(temperature=0.6, min_p=0.1)
    assert load_generation_config(tmp_path, "none") == ((), SamplingDefaults())
    for bad, field in (
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"top_p": 2}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"generation_config.json: {field}"):
            load_generation_config(tmp_path)


def _write(directory: Path, raw: object) -> None:
    (directory / "generation_config.json").write_text(json.dumps(raw))


def test_no_file_gives_no_eos_ids_and_empty_defaults(tmp_path: Path) -> None:
    assert load_generation_config(tmp_path) == ((), SamplingDefaults())


def test_one_eos_id_or_a_list_with_repeats_gives_each_id_once_in_order(tmp_path: Path) -> None:
    _write(tmp_path, {"eos_token_id": 2})
    assert load_generation_config(tmp_path)[0] == (2,)
    _write(tmp_path, {"eos_token_id": [9, 2, 9, 5]})
    assert load_generation_config(tmp_path)[0] == (9, 2, 5)


def test_an_integral_float_top_k_is_an_integer_and_unset_fields_stay_unset(
    tmp_path: Path,
) -> None:
    _write(tmp_path, {"top_k": 40.0, "temperature": 0, "do_sample": True})
    eos, defaults = load_generation_config(tmp_path)
    assert eos == () and defaults == SamplingDefaults(temperature=0.0, top_k=40)
    assert isinstance(defaults.top_k, int)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"top_k": 40.5}, "top_k must be an integer"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"temperature": True}, "temperature must be a number"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_k": float("inf")}, "top_k must be a finite number"),
        ({"min_p": float("nan")}, "min_p must be a finite number"),
        ({"eos_token_id": [1, True]}, "eos_token_id must be an id or a list of ids"),
        ({"eos_token_id": [-3]}, "eos_token_id"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_a_bad_field_is_refused_naming_the_file_and_field(
    tmp_path: Path, raw: object, message: str
) -> None:
    _write(tmp_path, raw)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_generation_config(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="generation_config must be auto or none, not 'off'"):
        load_generation_config(".", "off")
