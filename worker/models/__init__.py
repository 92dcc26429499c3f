"""Model registry: the class that runs each supported Hugging Face architecture."""

from __future__ import annotations

from worker.model_config import SUPPORTED_ARCHITECTURES
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_REGISTRY))}"
        ) from None
