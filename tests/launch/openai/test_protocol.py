"""The request bodies (protocol.py): sampling fields declared once, by SamplingParams, and
a bad body an APIError naming its field."""

from __future__ import annotations

import msgspec
import pytest

from launch.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
)
from launch.openai.responses_protocol import ResponsesRequest
from protocol.engine import SamplingParams

# Where a body's field differs from SamplingParams' (null for the default, one stop string).
HTTP_TYPES = {
    "max_tokens": int | None,
    "stop_token_ids": list[int] | None,
    "bad_words": list[str] | None,
    "stop": str | list[str] | None,
}


@pytest.mark.parametrize("body", [CompletionRequest, ChatCompletionRequest, ResponsesRequest])
def test_a_bodys_sampling_fields_are_sampling_params_declarations(body: type) -> None:
    declared = {f.name: f for f in msgspec.structs.fields(SamplingParams)}
    shared = [f for f in msgspec.structs.fields(body) if f.name in declared]
    assert {"temperature", "top_p", "seed", "stop", "presence_penalty"} <= {f.name for f in shared}
    for f in shared:
        if f.name in HTTP_TYPES:
            assert f.type == HTTP_TYPES[f.name] and f.default is None, f.name
        elif f.name not in ("structured_outputs", "logprobs"):  # the body's own types
            want = declared[f.name]
            assert (f.type, f.default) == (want.type, want.default), f.name


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b'{"prompt": "x", "temperature": "hot"}', "temperature", "invalid_type"),
        (b'{"prompt": "x", "bogus": 1}', "bogus", "unknown_parameter"),
        (b'{"max_tokens": 3}', "prompt", "missing_required_parameter"),
        (b'{"prompt": "x", "best_of": 2}', "best_of", "unsupported_parameter"),
        (b"{not json", None, "invalid_json"),
    ],
    ids=["wrong type", "unknown field", "missing prompt", "unsupported", "not JSON"],
)
def test_a_bad_body_names_its_field(raw: bytes, param: str | None, code: str) -> None:
    with pytest.raises(APIError) as bad:
        decode_body(raw, CompletionRequest)
    assert (bad.value.status, bad.value.param, bad.value.code) == (400, param, code)


def test_null_and_one_string_take_the_http_meanings() -> None:
    body = decode_body(b'{"prompt": "x", "stop": "a", "stop_token_ids": null}', CompletionRequest)
    assert body.stop_strings() == ["a"] and body.stop_token_ids is None
    assert body.n == 1 and body.skip_special_tokens and body.bad_words is None
