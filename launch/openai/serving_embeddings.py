"""POST /v1/embeddings: each input's embedding (EmbeddingParams: last-token pooling), one
prefill step per input, as one engine request of several prompts."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from launch.client.engine_processes import EngineDeadError
from launch.client.inputs import truncated
from launch.openai.protocol import APIError, EmbeddingRequest
from launch.openai.serving_base import (
    OpenAIServing,
    checked_truncation,
    json_response,
    off_loop,
    until_disconnect,
)
from protocol.engine import EmbeddingParams, SamplingParams


class EmbeddingServing(OpenAIServing):
    async def create(self, request: Request) -> Response:
        body: EmbeddingRequest = await self.read(request, EmbeddingRequest)
        self.check_model(body.model)
        engine = self.engine
        if body.dimensions is not None and not 1 <= body.dimensions <= engine.inputs.hidden_size:
            raise APIError(
                f"dimensions must be in [1, {engine.inputs.hidden_size}] (the model's "
                f"embedding width), got {body.dimensions}",
                param="dimensions",
                code="invalid_value",
            )
        prompts = await off_loop(self._prompts, body)
        self.ctx.admission.check_open()
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            embedding=EmbeddingParams(body.normalize, body.dimensions),
        )
        stream = engine.generate_many(prompts, params, f"embd-{uuid.uuid4().hex}", text=False)

        async def answer() -> Response:
            vectors: list[list[float] | None] = [None] * len(prompts)
            try:
                async for out in stream:
                    if out.finish_reason == "error":
                        raise APIError(out.error or "the request failed", 500)
                    if out.embedding is not None:
                        vectors[out.index] = out.embedding
            except EngineDeadError as e:
                raise APIError(str(e), 500) from None
            finally:
                stream.close()
            n = sum(len(p) for p in prompts)
            return json_response(
                {
                    "id": stream.request_id,
                    "object": "list",
                    "created": int(time.time()),
                    "model": self.ctx.model_name,
                    "data": _data(vectors, body.encoding_format),
                    "usage": {"prompt_tokens": n, "total_tokens": n},
                }
            )

        return await until_disconnect(request, answer())

    def _prompts(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, cut to truncate_prompt_tokens, each checked to fit."""
        engine = self.engine
        k = checked_truncation(body.truncate_prompt_tokens)
        prompts = []
        for i, item in enumerate(body.inputs()):
            try:
                ids = truncated(engine.prompt_token_ids(item), k, engine.max_model_len)
            except (TypeError, ValueError) as e:
                raise APIError(f"input {i}: {e}", param="input", code="invalid_value") from None
            if not ids:
                raise APIError(
                    f"input {i} is empty: give at least one token",
                    param="input",
                    code="invalid_value",
                )
            if len(ids) >= engine.max_model_len:
                raise APIError(
                    f"input {i} has {len(ids)} tokens; this model's context is "
                    f"{engine.max_model_len} (truncate_prompt_tokens cuts it)",
                    param="input",
                    code="context_length_exceeded",
                )
            prompts.append(ids)
        return prompts


def _data(vectors: list[list[float] | None], encoding_format: str) -> list[dict[str, Any]]:
    """The answer's data: each input's vector, as floats or base64 of little-endian f4."""
    data = []
    for i, v in enumerate(vectors):
        if v is None:
            raise APIError(f"input {i} got no embedding", 500)
        value: Any = v
        if encoding_format == "base64":
            value = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return data
