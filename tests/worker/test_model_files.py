"""A model's files as users bring them: generation_config.json (every EOS id, sampling
defaults), Hugging Face Hub ids resolved from the Hub's cache, and chat templates."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginecore.kv_cache_config import make_kv_cache_config
from enginecore.request import Request
from enginecore.scheduler import Scheduler
from launch import LLM, Prompt, SamplingParams
from launch.client.chat import ChatTemplate, ChatTemplateError
from protocol.engine import SamplingDefaults
from protocol.kv_cache import FullAttentionSpec
from tests.helpers.cli_helpers import CPU
from tests.helpers.kv_helpers import sched_config
from tests.helpers.model_files import CONVERSATION, FANCY, copy_model, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[11, 12, 13, 14, 15, 16], [40, 41, 42, 43]]
N = 12
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


# -- generation_config.json ---------------------------------------------------------
def test_unset_fields_take_the_defaults_and_set_ones_stay() -> None:
    config = make_kv_cache_config({"l0": FullAttentionSpec(16, 1, 8, "float32")}, 1 << 20)
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    scheduler = Scheduler(sched_config(64), config, 100, [2, 7], defaults)
    cases = {
        "unset": (SamplingParams(), (0.6, 0.9, 20)),
        "temperature": (SamplingParams(temperature=1.5), (1.5, 0.9, 20)),
        "greedy": (SamplingParams(temperature=0.0, top_k=0), (0.0, 0.9, 0)),
        "tiny": (SamplingParams(temperature=1e-39, top_p=1.0), (0.0, 1.0, 20)),
    }
    for rid, (params, want) in cases.items():
        hasher = scheduler.kv_cache_manager.block_hasher
        request = Request(rid, [1, 2, 3], hasher, sampling_params=params)
        assert scheduler.add_request(request) is None
        p = request.sampling_params
        assert (p.temperature, p.top_p, p.top_k) == want, rid


def test_every_eos_id_stops_and_generation_defaults_apply(llama_dir: Path, tmp_path: Path) -> None:
    with LLM(str(llama_dir), device=CPU) as llm:
        full = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # Two EOS ids, each the earlier stop of one prompt: the 3rd token of prompt 0 and the
    # 5th of prompt 1, where neither appears earlier in the other's continuation.
    picks = [
        (a, b)
        for a in range(2, 6)
        for b in range(2, 8)
        if full[0][a] not in full[0][:a] + full[1][: b + 1]
        and full[1][b] not in full[1][:b] + full[0][: a + 1]
    ]
    assert picks, f"no usable EOS pair in {full}"
    a, b = picks[0]
    eos = [full[0][a], full[1][b]]
    config_eos = json.loads((llama_dir / "config.json").read_text())["eos_token_id"]
    assert config_eos not in full[0] + full[1]
    model = copy_model(
        llama_dir, tmp_path / "m", {"eos_token_id": eos, "temperature": 0.0, "top_k": 7}
    )
    with LLM(str(model), device=CPU) as llm:
        assert llm.eos_token_ids == [config_eos, *eos]
        assert llm.get_default_sampling_params() == SamplingParams(
            temperature=0.0, top_p=1.0, top_k=7, min_p=0.0
        )
        # temperature unset: the file's 0 makes it greedy; a tiny one is greedy too.
        stopped = llm.generate(PROMPTS, SamplingParams(max_tokens=N), use_tqdm=False)
        tiny = SamplingParams(max_tokens=N, temperature=1e-39, ignore_eos=True)
        ignored = llm.generate(PROMPTS, tiny, use_tqdm=False)
    assert [o.token_ids for o in stopped] == [full[0][: a + 1], full[1][: b + 1]]
    assert [o.finish_reason for o in stopped] == ["stop", "stop"]
    assert [o.token_ids for o in ignored] == full
    assert [o.finish_reason for o in ignored] == ["length", "length"]
    # --generation-config none: the file is ignored, so neither id stops anything.
    with LLM(str(model), device=CPU, generation_config="none") as llm:
        assert llm.eos_token_ids == [config_eos]
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0), use_tqdm=False)
    assert [o.token_ids for o in outs] == full


# -- Hub ids --------------------------------------------------------------------------
def hub_cache(home: Path, repo_id: str, model: Path) -> str:
    """home/hub laid out as huggingface_hub lays out a downloaded snapshot: content in
    blobs/, the snapshot's files as relative symlinks into it, refs/main naming it."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in model.iterdir():
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


def offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_hub_ids_resolve_offline_from_the_cache(llama_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    commit = hub_cache(home, "testorg/tiny-llama", llama_dir)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in PROMPTS) + "\n")
    cmd = [sys.executable, "-m", "launch.cli", "generate", "--input", str(inp)]
    run = subprocess.run(
        [
            *cmd,
            *("--output", str(out), "--model", f"testorg/tiny-llama@{commit}", "--device", CPU),
            *("--temperature", "0", "--max-tokens", str(N), "--no-progress"),
        ],
        env=offline_env(home),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    with LLM(str(llama_dir), device=CPU) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert got == want

    resolve = (
        "from launch.client.hub import resolve_model; import sys; print(resolve_model(sys.argv[1]))"
    )
    snapshot = home / "hub" / "models--testorg--tiny-llama" / "snapshots" / commit
    found = subprocess.run(
        [sys.executable, "-c", resolve, "testorg/tiny-llama"],
        env=offline_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == snapshot

    missing = subprocess.run(
        [*cmd, "--output", str(tmp_path / "o2.jsonl"), "--model", "testorg/no-such-model"],
        env=offline_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1
    lines = [ln for ln in missing.stderr.splitlines() if "no-such-model" in ln]
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0], missing.stderr
    assert "Traceback" not in missing.stderr
    bad = subprocess.run(
        [*cmd, "--output", str(tmp_path / "o3.jsonl"), "--model", str(tmp_path / "nowhere")],
        env=offline_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "does not exist" in bad.stderr, bad.stderr


# -- chat templates -----------------------------------------------------------------
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Block tags on lines of their own, indented, as most real templates are written: only
# Jinja's trim_blocks and lstrip_blocks (transformers sets both) keep these lines out.
MULTILINE = """{% for m in messages %}
    {% if m['role'] == 'user' %}
<|user|> {{ m['content'] }}
    {% else %}
<|{{ m['role'] }}|> {{ m['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


@pytest.mark.parametrize(
    "template", [CHATML, FANCY, MULTILINE], ids=["chatml", "fancy", "multiline"]
)
def test_rendering_equals_transformers(tmp_path: Path, template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    word_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}, "test")
    for add in (True, False):
        want = hf.apply_chat_template(
            CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=add
        )
        assert ours.render(CONVERSATION, add) == want


def test_templates_run_sandboxed_and_bad_conversations_fail_clearly() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape, {}, "test").render(CONVERSATION)
    template = ChatTemplate(FANCY, {}, "test")
    with pytest.raises(ChatTemplateError, match="refused the conversation: no tools here"):
        template.render([{"role": "tool", "content": "x"}])
    for bad, match in (
        ([], "non-empty list"),
        ([{"content": "x"}], r"messages\[0\].role"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content"),
        ("hello", "non-empty list"),
    ):
        with pytest.raises(ChatTemplateError, match=match):
            template.render(bad)


def test_chat_through_the_engine(llama_dir: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    model = copy_model(llama_dir, tmp_path / "chat")
    word_tokenizer(model)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(model / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    want_ids = hf.apply_chat_template(
        CONVERSATION, chat_template=FANCY, tokenize=True, add_generation_prompt=True
    )
    if not isinstance(want_ids, list):  # newer transformers return a BatchEncoding
        want_ids = want_ids["input_ids"]
    with LLM(str(model), device=CPU) as llm:
        (chat,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
        (same,) = llm.generate([want_ids], GREEDY, use_tqdm=False)
        # A bad conversation fails alone; the rest of the batch is served.
        outs = llm.generate(
            [
                Prompt(messages=[{"role": "tool", "content": "x"}]),
                Prompt(messages=CONVERSATION, sampling_params=GREEDY),
            ],
            use_tqdm=False,
        )
    assert chat.prompt_token_ids == want_ids
    assert chat.token_ids == same.token_ids and chat.finish_reason == "length"
    assert outs[0].finish_reason == "error" and "no tools here" in (outs[0].error or "")
    assert outs[1].token_ids == chat.token_ids
    # A model that ships no template: a clear error, per request.
    with LLM(str(llama_dir), device=CPU) as llm:
        (out,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert out.finish_reason == "error" and "has no chat template" in (out.error or "")


def test_a_chat_template_given_replaces_the_model_s(llama_dir: Path, tmp_path: Path) -> None:
    """--chat-template (LLM's chat_template): a file, or the template itself; the model's
    special tokens still fill it; the ids are transformers' with that template."""
    from transformers import PreTrainedTokenizerFast

    from launch.client.inputs import InputProcessor

    model = copy_model(llama_dir, tmp_path / "chat")
    word_tokenizer(model)  # ships FANCY
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(model / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    template_file = tmp_path / "multiline.jinja"
    template_file.write_text(MULTILINE)
    chat = Prompt(messages=CONVERSATION)
    for given, template in ((str(template_file), MULTILINE), (CHATML, CHATML), (None, FANCY)):
        want = hf.apply_chat_template(
            CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        ids = InputProcessor(str(model), given).token_ids(chat, 1000)
        assert ids == hf.encode(want, add_special_tokens=False), given
    with pytest.raises(ValueError, match="no such file"):
        InputProcessor(str(model), str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template: the chat template does not parse"):
        InputProcessor(str(model), "{% for m in messages %")
    # Through the command line: refused before any engine process starts.
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    run = subprocess.run(
        [
            *(sys.executable, "-m", "launch.cli", "generate", "--model", str(model)),
            *("--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--device", CPU),
            *("--chat-template", str(tmp_path / "missing.jinja")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1 and "missing.jinja': no such file" in run.stderr, run.stderr
    assert "attention kernels" not in run.stderr  # no worker was started


def test_cli_messages_lines(llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(llama_dir, tmp_path / "chat")
    word_tokenizer(model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"messages": CONVERSATION}, {"messages": "oops"}, {"prompt_token_ids": PROMPTS[0]}]
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = subprocess.run(
        [
            *(sys.executable, "-m", "launch.cli", "generate", "--model", str(model)),
            *("--input", str(inp), "--output", str(out), "--device", CPU, "--no-progress"),
            *("--temperature", "0", "--max-tokens", "5"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert run.returncode == 1  # one line failed
    assert [r["finish_reason"] for r in results] == ["length", "error", "length"]
    assert f"{inp}:2" in results[1]["error"]
    assert len(results[0]["token_ids"]) == 5


# Tools as Qwen 2.5's template tests and renders them (abridged): `tools` is defined
# even when none are given, as transformers renders it.
TOOLS_TEMPLATE = (
    "{% if tools is not none %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "{% else %}(no tools){% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function | tojson }}</call>{% endfor %}"
    "{% endfor %}" + " " * 300  # longer than a file name may be
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tools_render_as_transformers_renders_them(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from launch.client.chat import ChatTemplate
    from launch.client.inputs import InputProcessor
    from launch.openai.tools import template_messages

    word_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]
    history = [*CONVERSATION, {"role": "assistant", "content": "", "tool_calls": calls}]
    wire = [  # the same conversation as a client sends it: arguments as JSON text
        *CONVERSATION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**calls[0], "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
            ],
        },
    ]
    ours = ChatTemplate(TOOLS_TEMPLATE, {}, "test")
    for tools in (TOOLS, None):
        want = hf.apply_chat_template(
            history, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False
        )
        assert ours.render(template_messages(wire), True, tools=tools) == want
        assert ours.render(template_messages(wire), True) == hf.apply_chat_template(
            history, chat_template=TOOLS_TEMPLATE, tokenize=False
        )
    # An inline --chat-template longer than a file name is a template, not a crash.
    chat = Prompt(messages=CONVERSATION, tools=TOOLS)
    text = InputProcessor(str(tmp_path), TOOLS_TEMPLATE).chat_text(chat)
    assert text.startswith('<tools>{"type": "function"')


TRIMMING = "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}[end]{% endfor %}"


@pytest.mark.parametrize(
    "template", [CHATML, FANCY, MULTILINE, TRIMMING], ids=["chatml", "fancy", "multiline", "trim"]
)
def test_continuing_the_final_message_renders_as_transformers(
    tmp_path: Path, template: str
) -> None:
    """The text ends right after the last message's content (its trailing spaces kept,
    unless the template trims them), so the model continues that message."""
    from transformers import PreTrainedTokenizerFast

    word_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}, "test")
    for last in ("I think ", "Sure", "  spaced  "):
        conversation = [*CONVERSATION[:2], {"role": "assistant", "content": last}]
        want = hf.apply_chat_template(
            conversation, chat_template=template, tokenize=False, continue_final_message=True
        )
        assert ours.render(conversation, False, continue_final_message=True) == want
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        ours.render(CONVERSATION, True, continue_final_message=True)
    dropping = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", {}, "test")
    with pytest.raises(ChatTemplateError, match="dropped the last message"):
        dropping.render(CONVERSATION, False, continue_final_message=True)
