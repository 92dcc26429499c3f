"""The one request path of LLM and AsyncLLM, with a stand-in for the engine processes:
outputs reach their request's sink, a stop string aborts the core request at once, and
the engine's death ends every open request. No processes start here."""

from __future__ import annotations

from typing import Any

import pytest

from launch.client.engine_client import EngineClient
from launch.client.engine_processes import EngineDeadError
from launch.client.inputs import InputProcessor, Prompt, RequestLimits
from launch.client.llm import LLM
from launch.client.tokenizer import ByteTokenizer
from protocol.engine import EngineOutputs, RequestOutput, SamplingParams


class FakeEngine:
    """EngineProcesses as the client uses it: what was sent, and outputs to hand back."""

    closed = False

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.batches: list[EngineOutputs | Exception] = []

    def add_request(self, request_id: str, ids: list[int], *_: Any) -> None:
        self.added.append(request_id)

    def abort(self, ids: list[str]) -> None:
        self.aborted += ids

    def get_outputs(self, timeout_ms: int = 500) -> EngineOutputs | None:
        if not self.batches:
            return None
        batch = self.batches.pop(0)
        if isinstance(batch, Exception):
            raise batch
        return batch

    def dead_reason(self) -> str | None:
        return None


def client(cls: type[EngineClient] = EngineClient) -> Any:
    """A client over FakeEngine, on the byte tokenizer (no model, no processes)."""
    c = cls.__new__(cls)
    c.inputs = InputProcessor.__new__(InputProcessor)
    c.inputs.model_dir, c.inputs.tokenizer, c.inputs.chat_template = "unused", ByteTokenizer(), None
    c.tokenizer = c.inputs.tokenizer
    c.vocab_size, c.max_model_len = 256, 64
    c.limits = RequestLimits(256, 64, "fcfs")
    c.engine = FakeEngine()
    c.stats = c.on_stats = c.dead_reason = None
    c._sinks, c._closing = {}, False
    if cls is LLM:
        c._next_id, c._closed = 0, False
    return c


def out(rid: str, text: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, list(text.encode()), finish)


def test_outputs_reach_the_sink_of_their_request_and_others_are_dropped() -> None:
    c = client()
    got: list[Any] = []
    one = c.prepare(Prompt(prompt_token_ids=[1, 2]), SamplingParams(n=2), "request r")
    for core_id, params, _ in c.sequences("r", one, text=True):
        c.send(core_id, one, params, got.append)
    assert c.engine.added == ["r-0", "r-1"] and c.num_open_requests == 2
    c.dispatch(EngineOutputs([out("r-1", "a"), out("gone", "b"), out("r-0", "c")]))
    assert [o.request_id for o in got] == ["r-1", "r-0"]
    with pytest.raises(ValueError, match="request id 'r-0' is already open"):
        c.sequences("r", one, text=True)
    c.abort_requests(["r-0", "r-0", "never"])
    assert c.engine.aborted == ["r-0"] and c.num_open_requests == 1
    c.fail_open(EngineDeadError("gone"))
    assert isinstance(got[-1], EngineDeadError) and c.num_open_requests == 0


def test_llm_ends_a_request_at_its_stop_string_and_aborts_it_in_the_core() -> None:
    llm = client(LLM)
    llm.engine.batches = [
        EngineOutputs([out("req-0", "ab"), out("req-1", "xy")]),
        EngineOutputs([out("req-0", "cSTOPd"), out("req-1", "z", "length")]),
    ]
    params = [SamplingParams(stop=["STOP"]), SamplingParams()]
    first, second = llm.generate([[1], [2]], params, use_tqdm=False)
    assert (first.text, first.finish_reason, first.stop_reason) == ("abc", "stop", "STOP")
    assert (second.text, second.finish_reason) == ("xyz", "length")
    assert llm.engine.aborted == ["req-0"] and llm.num_open_requests == 0


def test_llm_answers_every_prompt_when_the_engine_dies() -> None:
    llm = client(LLM)
    llm.engine.batches = [EngineOutputs([out("req-0", "a")]), EngineDeadError("worker died")]
    outs = llm.generate([[1], [999], [2]], SamplingParams(), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error", "error"]
    assert outs[1].error.startswith("prompt 1: token id 999 is outside the vocabulary")
    assert outs[0].error == outs[2].error == "worker died" and outs[0].text == "a"
    assert llm.dead_reason == "worker died" and llm.num_open_requests == 0
