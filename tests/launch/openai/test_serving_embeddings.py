"""Embeddings: the final hidden state at a prompt's last token (last-token pooling),
against transformers' own hidden states, through LLM.embed and the server's
/v1/embeddings (the official openai client)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from launch import LLM
from tests.helpers.cli_helpers import CPU
from tests.helpers.server import Server, post

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(50, 90))]


@pytest.fixture(scope="module")
def want(llama_dir: Path) -> list[np.ndarray]:
    """transformers' last-layer (normed) hidden state at each prompt's last token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out.append(states[-1][0, -1].numpy())
    return out


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.mark.parametrize(
    "flags",
    [{}, {"max_num_batched_tokens": 16}, {"tensor_parallel_size": 2}],
    ids=["plain", "chunked-prefill", "tp2"],
)
def test_embeddings_are_transformers_last_hidden_state(
    llama_dir: Path, want: list[np.ndarray], flags: dict
) -> None:
    with LLM(str(llama_dir), device=CPU, **flags) as llm:
        outs = llm.embed(PROMPTS, use_tqdm=False)
        # Again, the prompts' blocks now in the prefix cache: the last token still runs.
        again = llm.embed(PROMPTS, use_tqdm=False)
        raw = llm.embed(PROMPTS[:1], normalize=False, dimensions=8, use_tqdm=False)[0]
        mixed = llm.generate([PROMPTS[0]], use_tqdm=False)[0]
    for out, w in zip(outs, want):
        assert out.error is None and out.token_ids == [] and out.text is None
        np.testing.assert_allclose(out.embedding, _unit(w), atol=2e-5)
    assert again[2].num_cached_tokens > 0
    for out, w in zip(again, want):
        np.testing.assert_allclose(out.embedding, _unit(w), atol=2e-5)
    np.testing.assert_allclose(raw.embedding, want[0][:8], rtol=1e-4, atol=1e-5)
    assert mixed.embedding is None  # only who asks gets one


def test_the_embeddings_endpoint_through_the_openai_client(
    builtin_server: Callable[..., Server],
) -> None:
    server = builtin_server()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    texts = ["a cat", "a dog sat on the mat", "zebra"]
    got = client.embeddings.create(model="pagedserve-builtin", input=texts)
    assert [d.index for d in got.data] == [0, 1, 2] and got.usage.prompt_tokens > 0
    vectors = [np.array(d.embedding) for d in got.data]
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    with LLM(device=CPU) as llm:
        ours = llm.embed(texts, use_tqdm=False)
    for v, o in zip(vectors, ours):
        np.testing.assert_allclose(v, o.embedding, atol=1e-6)
    packed = client.embeddings.create(
        model="pagedserve-builtin", input=texts[:1], dimensions=16, encoding_format="base64"
    )
    raw = packed.data[0].embedding
    if isinstance(raw, str):  # the client returns what the server sent when asked for base64
        raw = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert len(raw) == 16 and abs(np.linalg.norm(raw) - 1) < 1e-5
    one = client.embeddings.create(model="pagedserve-builtin", input=[1, 2, 3])
    assert len(one.data) == 1
    for body, param in (
        ({"input": []}, "input"),
        ({"input": ["ok", 5]}, "input"),
        ({"input": "x", "dimensions": 10**6}, "dimensions"),
        ({"input": "x" * 5000}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ):
        status, answer = post(f"{server.url}/v1/embeddings", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = post(
        f"{server.url}/v1/embeddings", {"input": "x" * 5000, "truncate_prompt_tokens": 100}
    )
    assert status == 200 and answer["usage"]["prompt_tokens"] == 100, answer
