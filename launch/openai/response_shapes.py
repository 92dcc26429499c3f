"""The JSON shapes answers carry: server-sent events, usage, and token logprobs in each
endpoint's form (legacy completions, chat, vLLM's prompt_logprobs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from protocol.engine import Logprobs

_json = msgspec.json.Encoder()
# JSON may carry U+0085, U+2028 and U+2029 raw, but line readers that split like
# str.splitlines (httpx's iter_lines, for one) end a line there, inside an event: such
# a client loses the token. Escaped, the JSON decodes to the same text. (In UTF-8 these
# byte pairs and triples occur only as these characters.)
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse_event(body: object, event: str | None = None) -> bytes:
    """One server-sent event: `data: <JSON>` (after `event: <name>` when named, as the
    Responses API's are) and a blank line, no line break inside."""
    data = _json.encode(body)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    if event is not None:
        return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[Logprobs],
    token_text: Callable[[int], str],
    text_offset: int,
) -> dict[str, Any]:
    """The legacy completions shape for some tokens of a choice; text_offset is where the
    first starts in the choice's text (offsets add up each token's own text)."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    for t, lp in zip(token_ids, logprobs):
        text = token_text(t)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top: dict[str, float] = {}
        # Tokens whose texts coincide keep the likeliest's logprob; the chosen token is
        # always listed (as vLLM does).
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            top.setdefault(token_text(i), v)
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    token_ids: list[int], logprobs: list[Logprobs | None], token_text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else a map of token
    ids (the prompt's own, then the likeliest) to {logprob, decoded_token}."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for t, lp in zip(token_ids, logprobs):
        if lp is None:
            out.append(None)
            continue
        entries = {str(t): {"logprob": lp.logprob, "decoded_token": token_text(t)}}
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):
            entries.setdefault(str(i), {"logprob": v, "decoded_token": token_text(i)})
        out.append(entries)
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[Logprobs], token_text: Callable[[int], str]
) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""

    def entry(t: int, logprob: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for t, lp in zip(token_ids, logprobs):
        item = entry(t, lp.logprob)
        item["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content}
