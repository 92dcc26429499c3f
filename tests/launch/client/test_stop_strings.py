"""Stop strings on text alone: a match inside a character's bytes or over byte-fallback
tokens, and held-back text released once it cannot start a stop string."""

from __future__ import annotations

from pathlib import Path

from launch.client.detokenizer import IncrementalDetokenizer
from launch.client.stop_strings import StopStringMatcher
from launch.client.tokenizer import ByteTokenizer, HFTokenizer


def _stream(detok: IncrementalDetokenizer, matcher: StopStringMatcher, ids: list[int]) -> str:
    """What a client sees, one token per output, until a stop string matches."""
    shown = []
    for n, t in enumerate(ids, 1):
        delta = matcher.step(detok.step([t]), n)
        assert "\ufffd" not in delta
        shown.append(delta)
        if matcher.matched:
            return "".join(shown)
    return "".join(shown) + matcher.step(detok.flush(), len(ids)) + matcher.flush()


def test_a_stop_string_inside_a_multibyte_character_s_bytes() -> None:
    text = "añ€😀 ok €!"
    ids = list(text.encode())  # one token per byte: "€" is three tokens, "😀" four
    for stop, want in (("€", "añ"), ("😀 o", "añ€"), ("€!", "añ€😀 ok "), ("zz", text)):
        matcher = StopStringMatcher([stop])
        got = _stream(IncrementalDetokenizer(ByteTokenizer()), matcher, ids)
        assert got == want, stop
        assert matcher.matched == (None if stop == "zz" else stop)


def test_a_stop_string_over_byte_fallback_tokens(tmp_path: Path) -> None:
    # A SentencePiece-style BPE: characters outside its vocabulary become <0xNN> tokens.
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"a": 256, "b": 257, "▁": 258}
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token=None))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf_tok = HFTokenizer(tmp_path / "tokenizer.json")
    ids = hf_tok.encode("ab€aé€b", add_special_tokens=False)
    assert len(ids) == 12  # € and é fell back to their bytes
    matcher = StopStringMatcher(["é€", "bb"])
    assert _stream(IncrementalDetokenizer(hf_tok), matcher, ids) == "ab€a"
    assert matcher.matched == "é€"


def test_held_back_text_is_released_when_it_cannot_start_a_stop_string() -> None:
    matcher = StopStringMatcher(["abc", "xyz"])
    assert matcher.step("12a", 1) == "12"  # "a" may start "abc"
    assert matcher.step("b", 2) == ""
    assert matcher.step("d", 3) == "abd"
    assert matcher.step("x", 4) == ""
    assert matcher.flush() == "x"  # the end: nothing can match any more
    # Below min_tokens nothing matches and nothing is held back.
    early = StopStringMatcher(["abc"], min_tokens=2)
    assert early.step("abc", 1) == "abc"
    assert early.step("xab", 2) == "xab"
    # "ab" came from those first tokens, so "ab" + "c" is no match; "ab" may start one.
    assert early.step("cab", 3) == "c" and early.matched is None
