"""AsyncLLM: streams on one event loop equal to LLM's outputs, aborts when a consumer
leaves, and the engine's death reaching every open stream."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from launch import LLM, AsyncLLM, EngineDeadError, SamplingParams
from launch.client.async_llm import run
from launch.client.request_stream import RequestStream
from tests.helpers.cli_helpers import CPU
from tests.helpers.model_files import CONVERSATION

os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


def test_streams_equal_llm_and_leaving_early_aborts(chat_model: Path) -> None:
    prompts: list = [[11, 12, 13], "What is 2 + 2 ?", CONVERSATION]
    with LLM(str(chat_model), device=CPU) as llm:
        want = [o.token_ids for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)]
        want.append(llm.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].token_ids)
        texts = [llm.tokenizer.decode(ids) for ids in want]  # type: ignore[union-attr]

    async def collect(engine: AsyncLLM, prompt: object) -> tuple[list[int], str]:
        ids, text = [], ""
        async for out in engine.generate(prompt, GREEDY):  # type: ignore[arg-type]
            ids += out.new_token_ids
            text += out.text
        assert out.finish_reason == "length" and out.num_output_tokens == len(ids)
        return ids, text

    async def main() -> None:
        engine = await AsyncLLM.create(str(chat_model), device=CPU)
        try:
            # Many at once on one loop: each equals LLM's answer for its prompt.
            results = await asyncio.gather(*[collect(engine, p) for p in prompts * 100])
            assert results == list(zip(want, texts)) * 100
            # Leaving a stream (break) or cancelling its task aborts the request now.
            async for _ in engine.generate([5, 6, 7], LONG):
                break
            consumer = asyncio.ensure_future(collect(engine, [8, 9]))
            await asyncio.sleep(0)  # it sent its request and waits for tokens
            consumer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consumer
            assert engine.num_open_requests == 0
            await collect(engine, [1, 2])  # steps after the aborts: the pool is empty
            assert engine.stats is not None and engine.stats.kv_cache_usage == 0.0
            assert engine.stats.num_running == 0
            first = engine.generate([1], LONG, "same")
            with pytest.raises(ValueError, match="already open"):
                engine.generate([1], LONG, "same")
            await first.aclose()
            engine.generate([1], LONG, "same").close()  # a closed request's id is free
        finally:
            await engine.aclose()
        with pytest.raises(EngineDeadError, match="shut down"):
            engine.generate([1], GREEDY)

    run(main())  # on uvloop (the server's loop)


def test_a_dead_worker_ends_every_open_stream_naming_it() -> None:
    async def main() -> None:
        engine = await AsyncLLM.create(device=CPU)
        try:
            streams = [engine.generate([1, 2, i], LONG) for i in range(3)]
            for s in streams:
                await s.__anext__()  # every request is running
            os.kill(engine.engine.procs["worker rank 0"].pid, signal.SIGKILL)
            for s in streams:
                ends = []
                try:
                    async for out in s:
                        ends.append(out)
                except EngineDeadError as e:
                    ends.append(e)  # type: ignore[arg-type]
                last = ends[-1]
                message = str(last) if isinstance(last, Exception) else last.error
                assert "worker rank 0" in (message or ""), last
                # A caller that saw its request fail cannot send into the dying engine
                # (a data-parallel router would otherwise route there).
                assert not engine.can_send()
            reason = await asyncio.wait_for(engine.wait_dead(), 300)
            assert "worker rank 0" in reason and "killed by signal 9" in reason
            with pytest.raises(EngineDeadError, match="worker rank 0"):
                engine.generate([1], GREEDY)
        finally:
            await engine.aclose()
        assert all(p.poll() is not None for p in engine.engine.procs.values())

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_every_token_once_in_fewer_outputs(
    chat_model: Path,
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    async def until_queued_to_the_end(stream: RequestStream) -> None:
        """Wait (for an event, not a time) until the request's last output is queued."""
        inbox = stream.inbox
        while not any(getattr(o, "finish_reason", None) for o in inbox.items):
            inbox.waiter = asyncio.get_running_loop().create_future()
            await inbox.waiter  # the reader's next put

    async def main() -> None:
        engine = await AsyncLLM.create(str(chat_model), device=CPU)
        try:
            fast = [o async for o in engine.generate("What is 2 + 2 ?", params)]
            slow_stream = engine.generate("What is 2 + 2 ?", params)
            await asyncio.wait_for(until_queued_to_the_end(slow_stream), 300)
            slow = [o async for o in slow_stream]
        finally:
            await engine.aclose()
        assert len(fast) == 24 and len(slow) < len(fast)  # the engine ran ahead: merged
        assert [t for o in slow for t in o.new_token_ids] == [
            t for o in fast for t in o.new_token_ids
        ]
        assert "".join(o.text for o in slow) == "".join(o.text for o in fast)
        slow_lps = [lp for o in slow for lp in o.logprobs or []]
        fast_lps = [lp for o in fast for lp in o.logprobs or []]
        assert [lp.top_token_ids for lp in slow_lps] == [lp.top_token_ids for lp in fast_lps]
        assert [lp.logprob for lp in slow_lps] == pytest.approx([lp.logprob for lp in fast_lps])
        assert [o.finish_reason for o in slow][-1] == "length" == fast[-1].finish_reason
        assert slow[-1].num_output_tokens == 24

    run(main())
