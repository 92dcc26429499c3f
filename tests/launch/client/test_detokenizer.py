"""Incremental detokenizing: text deltas never split a character, and add up to the
whole decode."""

from __future__ import annotations

from pathlib import Path

from launch.client.detokenizer import IncrementalDetokenizer
from launch.client.tokenizer import ByteTokenizer, HFTokenizer
from tests.helpers.model_files import word_tokenizer


def test_text_deltas_never_split_a_character() -> None:
    text = "añ€😀 ok"
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas = [detok.step([b]) for b in text.encode()] + [detok.flush()]
    # One byte at a time: nothing until a character is whole, then exactly it.
    assert [d for d in deltas if d] == list(text)
    assert "\ufffd" not in "".join(deltas)


def test_an_unfinished_character_at_the_end_is_flushed_as_the_decode_has_it() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    ids = [*"é".encode(), *"€".encode()[:2]]
    assert "".join(detok.step([t]) for t in ids) == "é"
    assert detok.flush() == "\ufffd"  # what ByteTokenizer().decode(ids) ends with
    assert ByteTokenizer().decode(ids) == "é\ufffd"


def test_deltas_add_up_to_the_decode_with_word_joins(tmp_path: Path) -> None:
    word_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    ids = tok.encode("What is 2 + 2 ? You are terse", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([t]) for t in ids) + detok.flush() == tok.decode(ids)
