"""`pagedserve run-batch`: OpenAI's batch file format run offline through the server's own
routes. The oracle for the answers is LLM.generate / LLM.chat on the same model; bad lines
fail alone, in place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launch import LLM, SamplingParams
from tests.helpers.cli_helpers import CPU, ENV
from tests.helpers.model_files import CONVERSATION

N = 6
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
EXTRA = {"max_tokens": N, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "run-batch", "--device", CPU, *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_batch_file_is_answered_in_order_as_the_server_would(
    chat_model: Path, tmp_path: Path
) -> None:
    with LLM(str(chat_model), device=CPU) as llm:
        (chat,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
        (plain,) = llm.generate([[11, 12, 13]], GREEDY, use_tqdm=False)
    lines = [
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": CONVERSATION, **EXTRA},
        },
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "max_tokens": -1},
        },
        {
            "custom_id": "plain",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": [11, 12, 13], **EXTRA},
        },
        {"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}},
        {
            "custom_id": "stream",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "stream": True},
        },
        {
            "custom_id": "response",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"input": CONVERSATION, "max_output_tokens": N, "temperature": 0},
        },
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    target = tmp_path / "out.jsonl"
    done = _run("--model", str(chat_model), "-i", str(source), "-o", str(target))
    assert done.returncode == 0, done.stderr
    assert "7 requests, 4 failed" in done.stderr
    outs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in outs] == [x["custom_id"] for x in lines] + [None]
    assert len({o["id"] for o in outs}) == 7
    first = outs[0]["response"]
    assert first["status_code"] == 200 and first["request_id"] == first["body"]["id"]
    assert first["body"]["choices"][0]["token_ids"] == chat.token_ids
    assert outs[2]["response"]["body"]["choices"][0]["token_ids"] == plain.token_ids
    bad = outs[1]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    assert [o["error"]["code"] for o in outs[3:5] + outs[6:]] == ["invalid_line"] * 3
    assert all(o["response"] is None for o in outs[3:5] + outs[6:])
    answer = outs[5]["response"]["body"]
    assert answer["object"] == "response" and answer["usage"]["output_tokens"] <= N


def test_a_missing_input_stops_before_the_engine_starts(tmp_path: Path) -> None:
    done = _run("-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert done.returncode == 2 and "input file not found" in done.stderr
