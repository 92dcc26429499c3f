"""launch/client/tokenizer.py: the byte tokenizer's ids by hand, a model's tokenizer.json
through `tokenizers`, and which of the two (or none) a model directory gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.client.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.helpers.model_files import word_tokenizer
from worker.structured_output import BYTE_TOKENIZER_FILE


def test_byte_tokens_are_the_utf8_bytes_after_an_optional_bos() -> None:
    tok = ByteTokenizer(bos_token_id=300, eos_token_id=301)
    assert tok.encode("Aé") == [300, 0x41, 0xC3, 0xA9]
    assert tok.encode("Aé", add_special_tokens=False) == [0x41, 0xC3, 0xA9]
    assert tok.decode([300, 0x41, 0xC3, 0xA9, 301]) == "Aé"
    assert tok.decode([300, 0x41, 301, 999], skip_special_tokens=False) == "<s>A</s>"


def test_a_byte_sequence_cut_inside_a_character_decodes_to_the_replacement_character() -> None:
    assert ByteTokenizer().decode([0x41, 0xC3]) == "A\ufffd"


def test_a_model_directory_gets_its_tokenizer_json_or_the_byte_one_or_none(
    tmp_path: Path,
) -> None:
    assert load_tokenizer(tmp_path) is None
    (tmp_path / BYTE_TOKENIZER_FILE).write_text(json.dumps({"bos_token_id": 5, "eos_token_id": 6}))
    byte = load_tokenizer(tmp_path)
    assert isinstance(byte, ByteTokenizer) and (byte.bos_token_id, byte.eos_token_id) == (5, 6)
    word_tokenizer(tmp_path)  # tokenizer.json wins over the byte description
    hf = load_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer)
    ids = hf.encode("What is 2+4?", add_special_tokens=False)
    assert ids == [8, 9, 10, 11, 12, 13]  # the word list's positions in word_tokenizer
    assert hf.decode([1, *ids, 2]) == "What is 2 + 4 ?"
    assert hf.decode([1, *ids[:1], 2], skip_special_tokens=False) == "<s> What </s>"


def test_a_broken_tokenizer_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        load_tokenizer(tmp_path)
