"""A model's files as tests change them: a copy of a checkpoint with its own
generation_config.json, a word-level tokenizer that ships a chat template, and the
conversation the chat tests render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def copy_model(src: Path, dst: Path, generation_config: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


# Special-token variables, loop controls, raise_exception and tojson, as real templates
# use them.
FANCY = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tools here') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{{ {'n': messages | length, 'x': '<&>'} | tojson }}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)

# Leading and trailing spaces and markup characters, so trimming and escaping show.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2 + 2? <&>  "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


def word_tokenizer(path: Path) -> None:
    """A tiny word-level tokenizer.json (every id inside the test models' vocabulary) whose
    tokenizer_config.json ships FANCY as the chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
    words += ["system", "What", "is", "2", "+", "4", "?", "And", "3", "You", "are", "terse"]
    words += ["[", "]", "USER", "SYSTEM", "ASSISTANT", "{", "}", ":", ",", '"', "n", "x"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": FANCY})
    )
