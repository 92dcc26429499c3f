"""Tokenizers the launcher can use: a model's tokenizer.json, or the built-in byte one."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from worker.structured_output import read_byte_tokenizer


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens False: the text already holds them (a rendered chat)."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


_ENCODE_SLICE = 1 << 18


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; then BOS and EOS. Needs no files and no network."""

    def __init__(self, bos_token_id: int = 256, eos_token_id: int = 257) -> None:
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        ids = [self.bos_token_id] if add_special_tokens else []
        # A slice at a time, so that a thread building a huge prompt's list lets the
        # event loop's thread run between slices.
        for start in range(0, len(data), _ENCODE_SLICE):
            ids.extend(data[start : start + _ENCODE_SLICE])
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")
        names = {self.bos_token_id: b"<s>", self.eos_token_id: b"</s>"}
        raw = b"".join(bytes([t]) if 0 <= t < 256 else names.get(t, b"") for t in token_ids)
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer.json, through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own exception types
            raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The model directory's tokenizer, or None when it ships none (token-id prompts only)."""
    directory = Path(model_dir)
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory / "tokenizer.json")
    byte = read_byte_tokenizer(directory)
    return None if byte is None else ByteTokenizer(*byte)
