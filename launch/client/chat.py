"""Chat prompts: a conversation rendered to text by the model's own chat template.

The template is Jinja, shipped by the model (`chat_template.jinja`, `chat_template.json`,
or `chat_template` in `tokenizer_config.json`), so it is untrusted code: it runs in
Jinja's immutable sandbox, which blocks attribute tricks and mutation of our objects.
It is rendered the way transformers' `apply_chat_template` does (the same environment
options, helpers and special-token variables), so the text, and then the token ids,
equal what the model was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (bad messages, or the template refused it)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str], origin: str) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        # Jinja's own tojson escapes <, > and & for HTML; templates expect plain JSON.
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template does not parse: {e}") from None
        self.origin = origin
        self.special_tokens = dict(special_tokens)
        # Templates that concatenate content as a string get text parts joined, as vLLM
        # renders them; those that loop over a message's content get the parts.
        self.takes_parts = _loops_over_content(env.parse(source))

    def render(
        self,
        messages: object,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as text. continue_final_message: the text ends inside the last
        message, right after its content, so the model continues that message (a reply
        begun for it) instead of starting a new turn; not with add_generation_prompt."""
        import jinja2

        checked = check_messages(messages, join_parts=not self.takes_parts)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message continues the last message: it cannot be combined "
                    "with add_generation_prompt, which starts a new one"
                )
            checked = [*checked[:-1], _marked(checked[-1])]
        # transformers always defines tools and documents (None when not given), and
        # templates test them either way ("if tools", "tools is not none").
        variables = {**self.special_tokens, "tools": None, "documents": None, **template_kwargs}
        try:
            text = self._template.render(
                messages=checked, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        return _cut_at_mark(text) if continue_final_message else text


# Appended to the last message's text to find where it ends once rendered (what follows
# is the template's end of turn). Its trailing space shows whether the template trimmed
# the text: then the message's own trailing whitespace is gone too, as transformers has it.
_CONTINUE_MARK = "\u2063pagedserve-continue\u2063 "


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_MARK}
    if isinstance(content, list):
        parts = list(content)
        for i in range(len(parts) - 1, -1, -1):
            if isinstance(parts[i], dict) and "text" in parts[i]:
                parts[i] = {**parts[i], "text": parts[i]["text"] + _CONTINUE_MARK}
                return {**message, "content": parts}
    raise ChatTemplateError("continue_final_message: the last message has no text to continue")


def _cut_at_mark(text: str) -> str:
    mark = _CONTINUE_MARK.rstrip()
    at = text.rfind(mark)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template dropped the last message's text"
        )
    if text.startswith(_CONTINUE_MARK, at):
        return text[:at]
    return text[:at].rstrip()


def _loops_over_content(tree: Any) -> bool:
    """Whether a parsed template iterates over a message's content (message['content'],
    message.content, or a variable named content), i.e. takes OpenAI's list of parts."""
    from jinja2 import nodes

    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const):
            if it.arg.value == "content":
                return True
        elif isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        elif isinstance(it, nodes.Name) and it.name == "content":
            return True
    return False


def check_messages(messages: object, join_parts: bool = False) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of {"role": str, "content": str or text parts}.
    An assistant turn's content may be null (a turn of tool calls, as OpenAI's clients
    send it back): the template gets "", as vLLM renders it, since templates concatenate
    the content as a string. join_parts: text parts become one string, joined by
    newlines (for a template that concatenates content)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}"
                    )
            if join_parts:
                m = {**m, "content": "\n".join(part["text"] for part in content)}
        elif content is None and role == "assistant":
            m = {**m, "content": ""}
        elif not isinstance(content, str):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string or a list of text parts"
            )
        out.append(m)
    return out


def load_chat_template(model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
    """The model's chat template, or None when it ships none. override (--chat-template)
    replaces it: a Jinja file, or the template itself when it is no file but holds Jinja
    tags (as vLLM takes it); the model's special tokens still apply."""
    directory = Path(model_dir)
    special = _special_tokens(directory)
    if override is not None:
        path = Path(override)
        if _is_file(path):
            try:
                return ChatTemplate(path.read_text(), special, str(path))
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--chat-template {override}: cannot read it: {e}") from None
        if "{{" in override or "{%" in override:
            return ChatTemplate(override, special, "--chat-template")
        raise ValueError(
            f"--chat-template {override!r}: no such file (nor a template: it has no Jinja tags)"
        )
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), special, str(jinja_file))
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = directory / name
        raw = _read_json(path)
        if raw is None or raw.get("chat_template") is None:
            continue
        return ChatTemplate(_pick_template(raw["chat_template"], path), special, str(path))
    return None


def _is_file(path: Path) -> bool:
    """Whether path names a file; False for text no file can be named (an inline template
    longer than a file name may be: the system refuses to look it up)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _pick_template(value: object, path: Path) -> str:
    """A template string, or the "default" of a list of named ones."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template")
            for t in value
            if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
        if "default" in named:
            return named["default"]
        raise ValueError(f"{path}: chat_template lists {sorted(map(str, named))} but no default")
    raise ValueError(f"{path}: chat_template must be a string or a list of named templates")


def _special_tokens(directory: Path) -> dict[str, str]:
    """bos_token and friends as text, for templates that write them out."""
    tokens: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        raw = _read_json(directory / name) or {}
        for key in SPECIAL_TOKEN_NAMES:
            value = raw.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
    return tokens


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=tuple(separators) if separators else None,
        sort_keys=sort_keys,
    )
