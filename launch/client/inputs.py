"""What a request is made of, and how it becomes the token ids the engine takes.

Shared by the synchronous `LLM`, the asyncio `AsyncLLM` and the HTTP server, so a prompt
(text, token ids or a chat conversation) means the same thing through every door. It is
the client's one check of a request (sampling params, priority, stream interval,
truncation): a refusal is a RequestError naming the field, before anything is sent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from launch.client.chat import ChatTemplate, load_chat_template
from launch.client.tokenizer import Tokenizer, load_tokenizer
from protocol.engine import SamplingParams, priority_error, truncation_error
from worker.structured_output import grammar_of


@dataclass
class Prompt:
    """One input: text, token ids or a chat conversation (exactly one), with optional
    per-request settings. messages are rendered with the model's chat template."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    cache_salt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # Lower runs first under --scheduling-policy priority; non-zero fails under fcfs.
    priority: int = 0
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Function tools for the chat template, in OpenAI's shape (launch/openai/tools.py).
    tools: list[dict[str, Any]] | None = None
    # The output continues the last message (a reply begun for the model) rather than
    # starting a new turn; add_generation_prompt must then be False.
    continue_final_message: bool = False


def to_prompt(item: object) -> Prompt:
    """A Prompt from text, token ids or a Prompt."""
    if isinstance(item, Prompt):
        return item
    if isinstance(item, str):
        return Prompt(prompt=item)
    if isinstance(item, (list, tuple)):
        return Prompt(prompt_token_ids=list(item))
    raise TypeError(f"a prompt is a str, a list of token ids or a Prompt, not {item!r}")


class RequestError(ValueError):
    """A request refused at the client boundary, before anything is sent. The message
    names the request (what) and the fault; reason is the fault alone and param the
    field at fault, for a caller that reports them apart (the HTTP server's 400)."""

    def __init__(self, what: str | None, reason: str, param: str | None) -> None:
        super().__init__(f"{what}: {reason}" if what else reason)
        self.reason = reason
        self.param = param


class RequestLimits(NamedTuple):
    """What a request is checked against: the running engine's model and policy."""

    vocab_size: int
    max_model_len: int
    scheduling_policy: str


class PreparedPrompt(NamedTuple):
    """One prompt, checked and ready to send."""

    ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int


def checked_params(
    params: object, what: str, vocab_size: int, inputs: InputProcessor | None = None
) -> SamplingParams:
    """params, if it is a SamplingParams whose fields have the declared types and sane
    values (msgspec does not check types at construction: 8.0 would reach the wire), and
    whose structured output compiles (for inputs' model, which needs a tokenizer for it).
    what names the request in errors ("prompt 3"); a bad value raises RequestError."""
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"{what}: sampling params must be a SamplingParams, got {type(params).__name__}"
        )
    try:
        msgspec.convert(msgspec.structs.asdict(params), SamplingParams)
    except msgspec.ValidationError as e:
        raise TypeError(f"{what}: SamplingParams: {e}") from None
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise RequestError(what, str(e), str(e).split()[0]) from None
    if params.bad_words:
        params = _with_bad_words(params, what, vocab_size, inputs)
    width = None if params.embedding is None else params.embedding.dimensions
    if width is not None and inputs is not None and width > inputs.hidden_size:
        reason = f"dimensions {width} exceeds the model's embedding width {inputs.hidden_size}"
        raise RequestError(what, reason, "dimensions")
    if params.structured_outputs is not None:
        if inputs is not None and inputs.tokenizer is None:
            reason = (
                f"structured_outputs: model {inputs.model_dir} has no tokenizer "
                "(tokenizer.json), which they need"
            )
            raise RequestError(what, reason, "structured_outputs")
        try:
            grammar_of(params.structured_outputs)
        except ValueError as e:
            raise RequestError(what, str(e), "structured_outputs") from None
    return params


def _with_bad_words(
    params: SamplingParams, what: str, vocab_size: int, inputs: InputProcessor | None
) -> SamplingParams:
    """params with its bad words' token sequences, checked now that they exist."""
    if inputs is None or inputs.tokenizer is None:
        reason = "bad_words need the model's tokenizer (this model has none)"
        raise RequestError(what, reason, "bad_words")
    sequences = bad_word_sequences(inputs.tokenizer, params.bad_words, params.bad_words_token_ids)
    params = msgspec.structs.replace(params, bad_words_token_ids=sequences)
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise RequestError(what, str(e), str(e).split()[0]) from None
    return params


def check_priority(priority: object, policy: str, what: str | None = None) -> int:
    """priority, if the engine's scheduling policy can serve it (RequestError otherwise)."""
    error = priority_error(priority, policy)
    if error is not None:
        raise RequestError(what, error, "priority")
    return priority  # type: ignore[return-value]


def check_stream_interval(value: object, name: str) -> int:
    """A stream interval (tokens an output, at least 1); RequestError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(None, f"{name} must be an integer >= 1, got {value!r}", name)
    return value


def check_truncation(k: int | None) -> int | None:
    """A truncate_prompt_tokens, checked before any prompt is cut (RequestError)."""
    error = truncation_error(k)
    if error is not None:
        raise RequestError(None, error, "truncate_prompt_tokens")
    return k


def truncated(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt's ids as sent: the last k of them (truncate_prompt_tokens; -1: as many
    as the context holds), or all when k is None."""
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def bad_word_sequences(
    tokenizer: Tokenizer, words: list[str], given: list[list[int]]
) -> list[list[int]]:
    """The token sequences of bad words, after those given: each word as it starts a text
    and after a space (a word-initial token often carries its space), each once."""
    out = [list(seq) for seq in given]
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


class InputProcessor:
    """A model's tokenizer and chat template: prompts in, token ids out.

    load() finds the model's files (the built-in model, a directory or a Hub id) and
    checks its config before any engine process starts, so a bad model fails fast."""

    def __init__(self, model_dir: str, chat_template: str | None = None) -> None:
        self.model_dir = model_dir
        self.tokenizer: Tokenizer | None = load_tokenizer(model_dir)
        self.chat_template: ChatTemplate | None = load_chat_template(model_dir, chat_template)

    @classmethod
    def load(cls, model: str | None, chat_template: str | None = None) -> InputProcessor:
        """model: a local checkpoint directory, a Hub id (org/name[@revision]), or None
        for the built-in model; chat_template: a Jinja file or template that replaces the
        model's. Raises ValueError naming what is wrong."""
        from launch.client.hub import resolve_model
        from worker.model_config import load_model_config  # fails fast, naming the file

        if model is None:
            from launch.client.builtin_model import builtin_model_dir

            model = str(builtin_model_dir())
        else:
            model = resolve_model(model)
        load_model_config(model)
        return cls(model, chat_template)

    @functools.cached_property
    def hidden_size(self) -> int:
        """The model's hidden size: the width of its embeddings."""
        from worker.model_config import load_model_config

        return load_model_config(self.model_dir).hidden_size

    def token_ids(self, p: Prompt, vocab_size: int) -> list[int]:
        """The prompt's token ids; TypeError or ValueError says why it cannot be run."""
        given = (p.prompt is not None) + (p.prompt_token_ids is not None) + (p.messages is not None)
        if given != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids and messages")
        if p.messages is not None:
            # The rendered text already holds the template's special tokens (BOS too).
            return self.encode(self.chat_text(p), add_special_tokens=False)
        if p.prompt_token_ids is not None:
            ids = list(p.prompt_token_ids)
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool):
                    raise TypeError(f"prompt_token_ids holds {t!r}, not an int")
                if not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab_size})")
            return ids
        if not isinstance(p.prompt, str):
            raise TypeError(f"prompt must be a str, got {type(p.prompt).__name__}")
        return self.encode(p.prompt)

    def prepare(
        self,
        p: Prompt,
        params: SamplingParams | None,
        limits: RequestLimits,
        what: str,
        cache_salt: str | None = None,
        priority: int | None = None,
        checked: bool = False,
    ) -> PreparedPrompt:
        """A prompt's token ids (truncated as asked), its checked params (the call's, else
        the prompt's, else the defaults; checked: the call's passed checked_params
        already), cache salt and priority (the call's, else the prompt's): the one
        client-side check of a request. Raises naming `what`."""
        if params is None:
            params, checked = p.sampling_params, False
        if params is None:
            params, checked = SamplingParams(), True
        if not checked:
            params = checked_params(params, what, limits.vocab_size, self)
        priority = p.priority if priority is None else priority
        check_priority(priority, limits.scheduling_policy, what)
        ids = self.token_ids(p, limits.vocab_size)
        ids = truncated(ids, params.truncate_prompt_tokens, limits.max_model_len)
        return PreparedPrompt(ids, params, cache_salt or p.cache_salt, priority)

    def chat_text(self, p: Prompt) -> str:
        """p.messages rendered by the chat template (ChatTemplateError, a ValueError, for a
        conversation it refuses)."""
        if self.chat_template is None:
            raise ValueError(
                f"model {self.model_dir} has no chat template (no chat_template.jinja, and "
                "no chat_template in tokenizer_config.json): give a prompt instead, or a "
                "template with --chat-template"
            )
        return self.chat_template.render(
            p.messages,
            p.add_generation_prompt,
            p.continue_final_message,
            **{"tools": p.tools, **(p.chat_template_kwargs or {})},
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer().decode(token_ids)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: give prompt_token_ids")
        return self.tokenizer
