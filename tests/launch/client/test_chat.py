"""launch/client/chat.py: where a model's chat template is found, what a template sees
(special tokens, tojson, continue_final_message), and conversations refused by name.
Rendering against transformers' own is in tests/worker/test_model_files.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.client.chat import ChatTemplate, ChatTemplateError, check_messages, load_chat_template

PLAIN = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
HELLO = [{"role": "user", "content": "hi"}]


def _write(directory: Path, name: str, value: object) -> None:
    (directory / name).write_text(value if isinstance(value, str) else json.dumps(value))


def test_the_jinja_file_wins_then_chat_template_json_then_tokenizer_config(
    tmp_path: Path,
) -> None:
    assert load_chat_template(tmp_path) is None
    _write(tmp_path, "tokenizer_config.json", {"chat_template": "C", "bos_token": "<s>"})
    _write(tmp_path, "special_tokens_map.json", {"eos_token": {"content": "</s>"}})
    found = load_chat_template(tmp_path)
    assert found is not None and found.origin.endswith("tokenizer_config.json")
    assert found.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    _write(tmp_path, "chat_template.json", {"chat_template": "B"})
    assert load_chat_template(tmp_path).origin.endswith("chat_template.json")  # type: ignore[union-attr]
    _write(tmp_path, "chat_template.jinja", "A")
    assert load_chat_template(tmp_path).render(HELLO) == "A"  # type: ignore[union-attr]


def test_a_list_of_named_templates_gives_its_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    _write(tmp_path, "tokenizer_config.json", {"chat_template": named})
    assert load_chat_template(tmp_path).render(HELLO) == "D"  # type: ignore[union-attr]
    _write(tmp_path, "tokenizer_config.json", {"chat_template": named[:1]})
    with pytest.raises(ValueError, match=r"lists \['tool_use'\] but no default"):
        load_chat_template(tmp_path)
    _write(tmp_path, "tokenizer_config.json", {"chat_template": 3})
    with pytest.raises(ValueError, match="must be a string or a list"):
        load_chat_template(tmp_path)
    _write(tmp_path, "tokenizer_config.json", "[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_chat_template(tmp_path)


def test_an_override_is_a_file_or_inline_jinja_and_keeps_the_model_s_tokens(
    tmp_path: Path,
) -> None:
    _write(tmp_path, "tokenizer_config.json", {"chat_template": "model's", "bos_token": "<s>"})
    path = tmp_path / "mine.jinja"
    path.write_text("{{ bos_token }}file")
    assert load_chat_template(tmp_path, str(path)).render(HELLO) == "<s>file"  # type: ignore[union-attr]
    inline = load_chat_template(tmp_path, "{{ bos_token }}inline")
    assert inline is not None and inline.origin == "--chat-template"
    assert inline.render(HELLO) == "<s>inline"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(tmp_path, "missing.jinja")


def test_tojson_writes_plain_json_not_html_escaped() -> None:
    template = ChatTemplate("{{ tools | tojson }}", {}, "test")
    tools = [{"a": "<b> & é"}]
    assert template.render(HELLO, tools=tools) == json.dumps(tools, ensure_ascii=False)
    assert ChatTemplate("{{ tools | tojson }}", {}, "test").render(HELLO) == "null"


def test_continue_final_message_ends_right_after_its_text() -> None:
    template = ChatTemplate(PLAIN + "{% if add_generation_prompt %}[assistant]{% endif %}", {}, "t")
    reply = [*HELLO, {"role": "assistant", "content": "Once upon"}]
    assert (
        template.render(reply, False, continue_final_message=True) == "[user]hi[assistant]Once upon"
    )
    parts = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Once"}]}]
    with pytest.raises(ChatTemplateError, match="cannot be combined"):
        template.render(reply, True, continue_final_message=True)
    dropping = ChatTemplate("{% for m in messages %}[{{ m.role }}]{% endfor %}", {}, "t")
    with pytest.raises(ChatTemplateError, match="dropped the last message's text"):
        dropping.render(parts, False, continue_final_message=True)


def test_a_template_that_does_not_parse_names_its_origin() -> None:
    with pytest.raises(ValueError, match=r"my\.jinja: the chat template does not parse"):
        ChatTemplate("{% for %}", {}, "my.jinja")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user"}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "image"}]}], r"messages\[0\].content\[0\]"),
        (["hi"], r"messages\[0\] must be an object, got str"),
        ([{"role": "", "content": "x"}], r"messages\[0\].role must be a non-empty string"),
    ],
)
def test_a_malformed_conversation_is_refused_naming_the_message(
    messages: object, message: str
) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        check_messages(messages)


def test_an_assistant_message_may_carry_no_content() -> None:
    # (The template gets "", as vLLM renders it: templates add the content to a string.)
    calls = [*HELLO, {"role": "assistant", "content": None}]
    assert check_messages(calls) == [*HELLO, {"role": "assistant", "content": ""}]


PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
]


def test_text_parts_reach_a_concatenating_template_as_one_string() -> None:
    """OpenAI's clients (and vLLM's benchmark client) send content as text parts; a template
    that adds content to a string gets them joined by newlines, as vLLM renders them."""
    concatenating = ChatTemplate(
        "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}", {}, "t"
    )
    assert not concatenating.takes_parts
    assert concatenating.render(PARTS, False) == "<user>a\nb"
    assert ChatTemplate(PLAIN, {}, "t").render(PARTS, False) == "[user]a\nb"


@pytest.mark.parametrize(
    "loop",
    [
        "{% for p in m['content'] %}{{ p.text }}|{% endfor %}",
        "{% for p in m.content %}{{ p.text }}|{% endfor %}",
        "{% set content = m.content %}{% for p in content %}{{ p.text }}|{% endfor %}",
    ],
)
def test_a_template_that_loops_over_content_gets_the_parts(loop: str) -> None:
    template = ChatTemplate("{% for m in messages %}" + loop + "{% endfor %}", {}, "t")
    assert template.takes_parts
    assert template.render(PARTS, False) == "a|b|"
