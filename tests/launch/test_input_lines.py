"""`pagedserve generate` lines with the client-side sampling options: n, stop strings,
min_tokens, penalties, logit biases and logprobs, run through the real CLI on the built-in model.

The oracles do not read the CLI's code: the same requests through `LLM.generate` in this
process (seeds reproduce, penalties change the tokens), plain string search for stop
strings, and counts for min_tokens and logprobs. Stop strings and stop tokens are picked
from the model's own greedy output, so nothing depends on the random weights' values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launch import LLM, SamplingParams
from launch.client.llm import CompletionOutput
from tests.helpers.cli_helpers import CPU, generate_cli

# The keys a line without the new options has had all along, in their order.
PLAIN_KEYS = [
    "index",
    "prompt_token_ids",
    "token_ids",
    "finish_reason",
    "num_cached_tokens",
    "text",
]
GREEDY = {"temperature": 0, "ignore_eos": True}
MIN_TOKENS = 4
# Greedy, and EOS and stop tokens end the request.
ENDS_ON = {"prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": False}
SEEDED = {"prompt": "seeded", "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
# Candidates for the stop-string and penalty lines; the first that suits is used.
PROMPTS = ["aaaa", "abc", "The quick brown fox", "xyz xyz", "Hello world"]


def _params(line: dict[str, Any]) -> SamplingParams:
    """The SamplingParams a line asks for, spelled out here rather than taken from the CLI."""
    fields = {k: v for k, v in line.items() if k != "prompt"}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return SamplingParams(**fields)


@dataclass
class Run:
    inp: Path
    stderr: str
    returncode: int
    lines: list[dict[str, Any]]  # the input lines, as sent
    results: list[dict[str, Any]]  # the output lines, in file order
    names: dict[str, int]  # line name -> its index
    stop: str
    stop_token: int
    llm: LLM

    def of(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.results if r["index"] == self.names[name]]

    def one(self, name: str) -> dict[str, Any]:
        (result,) = self.of(name)
        assert result["finish_reason"] != "error", result
        return result

    def oracle(self, name: str) -> list[CompletionOutput]:
        line = self.lines[self.names[name]]
        return self.llm.generate(line["prompt"], _params(line), use_tqdm=False)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(None, device=CPU) as engine:
        yield engine


@pytest.fixture(scope="module")
def run(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Run:
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = {p: o for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False))}

    # A two-character stop string that first appears after the first token, in ASCII text
    # (one byte, one token: the streamed and the whole-decoded text agree exactly).
    def suits(text: str) -> bool:
        return text[:3].isascii() and text.index(text[1:3]) == 1

    stop_prompt = next((p for p in PROMPTS if suits(plain[p].text)), None)
    assert stop_prompt is not None, {p: o.text for p, o in plain.items()}
    stop = plain[stop_prompt].text[1:3]
    penalized = SamplingParams(**PENALTIES, max_tokens=8, temperature=0, ignore_eos=True)
    changed = llm.generate(PROMPTS, penalized, use_tqdm=False)
    pen_prompt = next(
        (p for p, o in zip(PROMPTS, changed) if o.token_ids != plain[p].token_ids), None
    )
    assert pen_prompt is not None, "the penalties change no candidate's greedy tokens"
    # The greedy run's second token as a stop token: without min_tokens it ends at 2 tokens.
    stop_token = plain[ENDS_ON["prompt"]].token_ids[1]

    named: list[tuple[str, dict[str, Any] | str]] = [
        ("plain", {"prompt": stop_prompt, "max_tokens": 8, **GREEDY}),
        ("stop", {"prompt": stop_prompt, "max_tokens": 8, **GREEDY, "stop": stop}),
        ("stop_list", {"prompt": stop_prompt, "max_tokens": 8, **GREEDY, "stop": ["zq~", stop]}),
        ("stop_token", {**ENDS_ON, "stop_token_ids": [stop_token]}),
        ("min_tokens", {**ENDS_ON, "stop_token_ids": [stop_token], "min_tokens": MIN_TOKENS}),
        ("penalties", {"prompt": pen_prompt, "max_tokens": 8, **GREEDY, **PENALTIES}),
        ("bad_n", '{"prompt": "x", "n": 0}'),
        ("logprobs", {"prompt": "abc", "max_tokens": 4, **GREEDY, "logprobs": 2}),
        ("prompt_logprobs", {"prompt": "abcd", "max_tokens": 2, **GREEDY, "prompt_logprobs": 1}),
        ("seeded", {**SEEDED, "ignore_eos": True}),
        ("bad_penalty", '{"prompt": "x", "repetition_penalty": 0}'),
        # JSON keys are strings: the line's token ids come as "65".
        (
            "logit_bias",
            '{"prompt": "abc", "max_tokens": 3, "temperature": 0, '
            '"ignore_eos": true, "logit_bias": {"65": 100}}',
        ),
    ]
    raw = [line if isinstance(line, str) else json.dumps(line) for _, line in named]
    tmp = tmp_path_factory.mktemp("sampling_lines")
    proc, results = generate_cli(None, raw, tmp)  # type: ignore[arg-type]
    return Run(
        inp=tmp / "in.jsonl",
        stderr=proc.stderr,
        returncode=proc.returncode,
        lines=[json.loads(x) for x in raw],
        results=results,
        names={name: i for i, (name, _) in enumerate(named)},
        stop=stop,
        stop_token=stop_token,
        llm=llm,
    )


def test_bad_lines_fail_alone_naming_their_line(run: Run) -> None:
    bad = {run.names["bad_n"], run.names["bad_penalty"]}
    for name, want in (
        ("bad_n", "n must be in [1, 16], got 0"),
        ("bad_penalty", "repetition_penalty must be > 0"),
    ):
        (result,) = run.of(name)
        where = f"{run.inp}:{run.names[name] + 1}: "
        assert result["finish_reason"] == "error" and result["error"].startswith(where + want)
        assert where + want in run.stderr
    good = [r for r in run.results if r["index"] not in bad]
    assert all(r["finish_reason"] != "error" and r["token_ids"] for r in good), good
    assert run.returncode == 1  # some lines failed: not a clean run
    # Twelve prompts, 14 completions: the seeded line's three copies, the rest one each.
    assert "prompts: 12 | completions: 14 (2 failed)" in run.stderr, run.stderr
    assert "2 of 14 completions failed" in run.stderr
    assert [r["index"] for r in run.results] == sorted(r["index"] for r in run.results)


def test_prompt_logprobs_give_one_entry_per_prompt_token(run: Run) -> None:
    result = run.one("prompt_logprobs")
    entries = result["prompt_logprobs"]
    assert len(entries) == len(result["prompt_token_ids"]) and entries[0] is None
    (want,) = run.oracle("prompt_logprobs")
    assert want.prompt_logprobs is not None
    for entry, lp in zip(entries[1:], want.prompt_logprobs[1:]):
        assert lp is not None and len(entry["top_token_ids"]) == 1
        assert entry["top_token_ids"] == lp.top_token_ids
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
    assert "prompt_logprobs" not in run.one("plain")


def test_a_logit_bias_line_forces_its_token(run: Run) -> None:
    assert run.one("logit_bias")["token_ids"] == [65, 65, 65]


def test_n_copies_are_lines_of_one_index_in_seq_order_and_reproduce(run: Run) -> None:
    copies = run.of("seeded")
    assert [c["seq_index"] for c in copies] == [0, 1, 2]
    assert all(len(c["token_ids"]) == SEEDED["max_tokens"] for c in copies)
    assert len({tuple(c["token_ids"]) for c in copies}) == 3  # seeds 11, 12, 13 differ
    again = run.oracle("seeded")
    assert [(o.seq_index, o.token_ids) for o in again] == [
        (c["seq_index"], c["token_ids"]) for c in copies
    ]


def test_logprobs_give_one_entry_per_token_with_the_alternatives(run: Run) -> None:
    result = run.one("logprobs")
    entries = result["logprobs"]
    assert len(entries) == len(result["token_ids"]) == 4
    for token, entry in zip(result["token_ids"], entries):
        assert entry["logprob"] <= 0.0
        assert len(entry["top_token_ids"]) == len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0] >= entry["top_logprobs"][1]
        # Greedy without penalties: the chosen token is the most likely one.
        assert entry["top_token_ids"][0] == token
        assert entry["top_logprobs"][0] == entry["logprob"]
    (want,) = run.oracle("logprobs")
    assert want.logprobs is not None and result["token_ids"] == want.token_ids
    for entry, lp in zip(entries, want.logprobs):
        assert entry["top_token_ids"] == lp.top_token_ids
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4)


def test_a_stop_string_ends_the_text_before_it(run: Run) -> None:
    full = run.one("plain")
    for name in ("stop", "stop_list"):
        cut = run.one(name)
        assert run.stop not in cut["text"]
        assert full["text"].startswith(cut["text"])
        assert cut["text"] == full["text"][: full["text"].index(run.stop)]
        assert cut["finish_reason"] == "stop" and cut["stop_reason"] == run.stop
        # The token ids run to the token that completed the match, and no further.
        assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])]
        assert len(cut["token_ids"]) < len(full["token_ids"])


def test_min_tokens_holds_the_stop_token_back(run: Run) -> None:
    early = run.one("stop_token")
    assert early["token_ids"][-1] == run.stop_token and len(early["token_ids"]) < MIN_TOKENS
    held = run.one("min_tokens")
    assert len(held["token_ids"]) >= MIN_TOKENS
    assert run.stop_token not in held["token_ids"][:-1]  # it ends the request where it comes
    assert held["token_ids"] == run.oracle("min_tokens")[0].token_ids


def test_penalties_reach_the_engine(run: Run) -> None:
    result = run.one("penalties")
    (want,) = run.oracle("penalties")
    assert result["token_ids"] == want.token_ids
    without = {k: v for k, v in run.lines[run.names["penalties"]].items() if k not in PENALTIES}
    (plain,) = run.llm.generate(without["prompt"], _params(without), use_tqdm=False)
    assert plain.token_ids != want.token_ids  # the fixture chose a prompt they change


def test_lines_without_the_new_options_keep_their_keys(run: Run) -> None:
    for name in ("plain", "stop_token"):
        assert list(run.one(name)) == PLAIN_KEYS
    assert list(run.one("logprobs")) == [*PLAIN_KEYS, "logprobs"]
    assert list(run.one("stop")) == [*PLAIN_KEYS, "stop_reason"]
