"""serve_bench's clients: one streaming completion per request through the official
`openai` client, each chunk's token ids stamped as they arrive (TTFT, ITL)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec


@dataclass
class Result:
    """One request as a client saw it (times in seconds, from perf_counter)."""

    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


def _create_args(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion's arguments. The prompt's token ids ride in extra_body,
    the same JSON on the wire: the SDK's typed transform walks a list of ids one element
    at a time on the client's CPU before anything is sent, which would add to the TTFT
    the client sees and spread each wave's arrivals."""
    return {
        "model": model,
        "prompt": "",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"prompt": prompt, "ignore_eos": True, "return_token_ids": True},
    }


class _Clock:
    """Stamps a request's chunks: TTFT, the gaps between chunks with tokens (ITL)."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.start = self.last = time.perf_counter()

    def tokens(self, ids: list[int]) -> None:
        if not ids:
            return
        now = time.perf_counter()
        res = self.res
        if res.ttft is None:
            res.ttft = now - self.start
        else:
            res.itl.append(now - self.last)
        self.last = now
        res.token_ids.extend(ids)


async def _one_typed(client: Any, model: str, prompt: list[int], max_tokens: int) -> Result:
    """The official client as a user calls it: each chunk parsed into its typed objects."""
    res = Result()
    clock = _Clock(res)
    try:
        stream = await client.completions.create(**_create_args(model, prompt, max_tokens))
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                clock.tokens(getattr(choice, "token_ids", None) or [])
                if choice.finish_reason is not None:
                    res.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                res.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                res.cached_tokens = (details.cached_tokens or 0) if details else 0
    except Exception as e:  # one failed request is reported, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - clock.start
    return res


_decode = msgspec.json.Decoder()


async def _one_raw(client: Any, model: str, prompt: list[int], max_tokens: int) -> Result:
    """The official client's raw streaming response (its HTTP, retries and errors), the
    events decoded here with msgspec: building typed objects per chunk costs the client
    more CPU than the server spends on it, on the cores the server needs."""
    res = Result()
    clock = _Clock(res)
    try:
        async with client.completions.with_streaming_response.create(
            **_create_args(model, prompt, max_tokens)
        ) as response:
            async for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = _decode.decode(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                for choice in chunk["choices"]:
                    clock.tokens(choice.get("token_ids") or [])
                    if choice.get("finish_reason") is not None:
                        res.finish_reason = choice["finish_reason"]
                u = chunk.get("usage")
                if u is not None:
                    res.prompt_tokens = u["prompt_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
    except Exception as e:  # one failed request is reported, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - clock.start
    return res


async def drive(
    url: str, model: str, prompts: list[list[int]], a: argparse.Namespace, concurrency: int
) -> tuple[list[Result], float]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        max_retries=0,
        timeout=a.request_timeout,
        http_client=openai.DefaultAioHttpClient(timeout=a.request_timeout),
    )
    results: list[Result] = [Result() for _ in prompts]
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(a.seed)

    one = _one_raw if a.client == "raw" else _one_typed

    async def run(i: int) -> None:
        async with gate:
            results[i] = await one(client, model, prompts[i], a.max_tokens)

    start = time.perf_counter()
    try:
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.ensure_future(run(i)))
            if a.request_rate:
                await asyncio.sleep(rng.expovariate(a.request_rate))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return results, time.perf_counter() - start
