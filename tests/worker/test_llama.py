"""Our paged Llama-family model against Hugging Face transformers, the oracle.

Tiny random checkpoints are built with transformers and saved as safetensors; we load
them through load_model_config + iterate_weights and run mixed paged batches by hand
(prefill, chunked prefill, decode in one step), comparing logits at every computed
position with transformers' logits over the full sequence, and greedy tokens with
transformers' own generate().
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from protocol.kv_cache import FullAttentionSpec, SlidingWindowSpec
from tests.helpers.hf_checkpoints import (
    CHECKPOINTS,
    hf_greedy,
    save_checkpoint,
    small_model_config,
)
from tests.helpers.paged_harness import GEN_TOKENS, PagedHarness, paged_prompts, run_paged_batches
from worker.model_config import (
    ModelConfig,
    load_model_config,
)
from worker.models import get_model_class
from worker.models.llama import LlamaForCausalLM
from worker.weights import iterate_weights


def _load(path: Path) -> tuple[LlamaForCausalLM, ModelConfig]:
    config = load_model_config(path)
    model = get_model_class(config.architecture)(config, torch.float32, torch.device("cpu"))
    model.load_weights(iterate_weights(path))
    return model, config


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_paged_batches_match_transformers(name: str, tmp_path: Path) -> None:
    hf_model = save_checkpoint(name, tmp_path)
    model, config = _load(tmp_path)
    harness = PagedHarness(model, config, num_groups=2 if name == "qwen2" else 1)

    prompts = paged_prompts()
    reqs = run_paged_batches(harness, prompts)
    for key, req in reqs.items():
        assert len(req.generated) == GEN_TOKENS, key
        full = torch.tensor([req.token_ids[:-1]])  # the last sample has no logits yet
        with torch.no_grad():
            want = hf_model(full).logits[0].float()
        positions = sorted(req.logits)
        assert positions == list(range(full.shape[1])), key
        got = torch.stack([req.logits[p] for p in positions])
        torch.testing.assert_close(
            got, want, atol=1e-4, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}"
        )

        assert hf_greedy(hf_model, prompts[key], GEN_TOKENS) == req.generated, key


def test_kv_cache_specs_follow_layer_windows(tmp_path: Path) -> None:
    save_checkpoint("mistral", tmp_path)
    model, _ = _load(tmp_path)
    specs = model.kv_cache_specs(16, "bfloat16")
    assert specs == {
        f"model.layers.{i}.self_attn": SlidingWindowSpec(16, 2, 32, "bfloat16", 6) for i in range(2)
    }
    llama_cfg = small_model_config("LlamaForCausalLM")
    llama = LlamaForCausalLM(llama_cfg, torch.float32, torch.device("cpu"))
    assert llama.kv_cache_specs(4, "float16") == {
        f"model.layers.{i}.self_attn": FullAttentionSpec(4, 2, 16, "float16") for i in range(2)
    }


def test_weight_load_errors_name_the_missing_unexpected_or_misshapen_tensor() -> None:
    model = LlamaForCausalLM(
        small_model_config("LlamaForCausalLM"), torch.float32, torch.device("cpu")
    )
    weights = dict(model.state_dict())
    with pytest.raises(ValueError, match=re.escape("missing weights: model.norm.weight")):
        model.load_weights((k, v) for k, v in weights.items() if k != "model.norm.weight")
    with pytest.raises(ValueError, match=re.escape("unexpected weight 'model.extra'")):
        model.load_weights([*weights.items(), ("model.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match=re.escape("'lm_head.weight' has shape")):
        model.load_weights({**weights, "lm_head.weight": torch.zeros(3, 64)}.items())
