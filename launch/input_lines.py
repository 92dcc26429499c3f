"""`pagedserve generate`'s input: one JSON object a line, a prompt and its sampling options.

A line's sampling options are SamplingParams' own fields, derived from its declaration
(so each is declared once); unset ones take the command-line flag's default, else
SamplingParams'. A bad line fails alone, with its file and line number.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from launch.client.inputs import Prompt
from launch.openai.protocol import StructuredOutputsBody
from protocol.engine import SamplingParams

# SamplingParams' fields a line cannot set: the client fills them in, or other APIs ask.
_NOT_ON_A_LINE = ("bad_words_token_ids", "embedding")
# Fields a line spells as OpenAI's API does: stop as one string or a list; vLLM's
# structured_outputs {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}.
_SPELLED_AS_IN_THE_API: dict[str, Any] = {
    "stop": str | list[str],
    "structured_outputs": StructuredOutputsBody,
}
# Fields whose unset value on a line takes a command-line flag's (generate's flags).
_FLAG_DEFAULTS = ("max_tokens", "temperature", "top_p", "top_k", "min_p")

_SAMPLING_FIELDS = [
    f for f in msgspec.structs.fields(SamplingParams) if f.name not in _NOT_ON_A_LINE
]
# One line: the prompt (text, token ids or a chat conversation rendered with the model's
# chat template), each sampling field (None: unset), its cache salt, and its priority
# (lower runs first under --scheduling-policy priority). logit_bias's keys are token ids
# (a JSON object's keys, so strings of digits).
InputLine = msgspec.defstruct(
    "InputLine",
    [
        ("prompt", str | None, None),
        ("prompt_token_ids", list[int] | None, None),
        ("messages", list[dict[str, Any]] | None, None),
        *[
            (f.name, _SPELLED_AS_IN_THE_API.get(f.name, f.type) | None, None)
            for f in _SAMPLING_FIELDS
        ],
        ("cache_salt", str | None, None),
        ("priority", int, 0),
    ],
    forbid_unknown_fields=True,
    module=__name__,
)

# InputLine fields passed to SamplingParams as they are, when set.
_LINE_OPTIONS = tuple(
    f.name
    for f in _SAMPLING_FIELDS
    if f.name not in _FLAG_DEFAULTS and f.name not in _SPELLED_AS_IN_THE_API
)


def read_inputs(path: Path, args: argparse.Namespace) -> list[tuple[int, Prompt | str]]:
    """(line number, Prompt) for each non-blank line, or (line number, error string) for a
    bad one, which fails alone."""
    decoder = msgspec.json.Decoder(InputLine)
    items: list[tuple[int, Prompt | str]] = []
    for n, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            items.append((n, _prompt(decoder.decode(raw), args)))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            items.append((n, f"{path}:{n}: {e}"))
    return items


def _prompt(line: Any, args: argparse.Namespace) -> Prompt:
    """The line's prompt with its checked sampling params (ValueError naming the field)."""
    # Options the line leaves unset take SamplingParams' own defaults (one source); those
    # with a command-line flag take the flag's.
    options = {k: getattr(line, k) for k in _LINE_OPTIONS if getattr(line, k) is not None}
    for name in _FLAG_DEFAULTS:
        value = getattr(line, name)
        options[name] = getattr(args, name) if value is None else value
    if line.stop is not None:
        options["stop"] = [line.stop] if isinstance(line.stop, str) else line.stop
    if line.structured_outputs is not None:
        options["structured_outputs"] = line.structured_outputs.to_wire()
    params = SamplingParams(**options)
    # Here, not only in the client: a bad line fails alone naming its file and line, and
    # before the engine starts (the client checks it again against the model).
    params.validate()
    return Prompt(
        line.prompt,
        line.prompt_token_ids,
        params,
        line.cache_salt,
        messages=line.messages,
        priority=line.priority,
    )
