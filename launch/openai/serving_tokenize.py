"""vLLM's POST /tokenize and POST /detokenize: the token ids a request would send, and
token ids back to text."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from launch.client.inputs import Prompt
from launch.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest
from launch.openai.serving_base import OpenAIServing, json_response, off_loop
from launch.openai.tools import template_messages


class TokenizeServing(OpenAIServing):
    async def tokenize(self, request: Request) -> Response:
        """The ids a completion (prompt) or a chat completion (messages) would send."""
        body: TokenizeRequest = await self.read(request, TokenizeRequest)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", code="invalid_value")
        ids = await off_loop(self._token_ids, body)
        answer = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:  # vLLM's: each token's own text
            answer["token_strs"] = [self.ctx.token_text(t) for t in ids]
        return json_response(answer)

    def _token_ids(self, body: TokenizeRequest) -> list[int]:
        inputs = self.engine.inputs
        try:
            if body.prompt is not None:
                special = True if body.add_special_tokens is None else body.add_special_tokens
                ids = inputs.encode(body.prompt, special)
            else:
                chat = Prompt(
                    messages=template_messages(body.messages),
                    add_generation_prompt=body.add_generation_prompt,
                    chat_template_kwargs=body.chat_template_kwargs,
                    tools=[msgspec.to_builtins(t) for t in body.tools] if body.tools else None,
                    continue_final_message=body.continue_final_message,
                )
                ids = inputs.encode(inputs.chat_text(chat), bool(body.add_special_tokens))
        except (TypeError, ValueError) as e:
            param = "prompt" if body.prompt is not None else "messages"
            raise APIError(str(e), param=param, code="invalid_value") from None
        return ids

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await self.read(request, DetokenizeRequest)
        self.check_model(body.model)
        return json_response({"prompt": await off_loop(self._text, body.tokens)})

    def _text(self, tokens: list[int]) -> str:
        try:  # the range check every token-id prompt gets
            return self.engine.inputs.decode(self.engine.prompt_token_ids(tokens))
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param="tokens", code="invalid_value") from None
