"""launch/client/builtin_model.py: the built-in model is an ordinary Hugging Face Llama
directory (loaded as any checkpoint is), written once into the cache, the same
weights every time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.client.builtin_model import NAME, builtin_model_dir, write_llama_checkpoint
from protocol import envs
from worker.model_config import load_model_config
from worker.models.llama import LlamaForCausalLM
from worker.structured_output import read_byte_tokenizer
from worker.weights import iterate_weights

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def test_a_written_checkpoint_loads_with_every_weight_in_its_shape(tmp_path: Path) -> None:
    write_llama_checkpoint(tmp_path, TINY, seed=7)
    config = load_model_config(tmp_path)
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    model.load_weights(iterate_weights(tmp_path))  # refuses missing, extra or misshapen ones
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 4, 16)  # kv heads x dim
    assert saved["model.norm.weight"].eq(1).all()
    assert abs(saved["model.embed_tokens.weight"].std().item() - 0.02) < 0.005  # default std
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])


def test_the_same_seed_draws_the_same_weights(tmp_path: Path) -> None:
    write_llama_checkpoint(tmp_path / "a", TINY, seed=7)
    write_llama_checkpoint(tmp_path / "b", TINY, seed=7)
    write_llama_checkpoint(tmp_path / "c", TINY, seed=8)
    a, b, c = (load_file(str(tmp_path / d / "model.safetensors")) for d in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_the_builtin_model_is_written_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envs.CACHE, str(tmp_path))
    directory = builtin_model_dir()
    assert directory == tmp_path / NAME
    config = json.loads((directory / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == read_byte_tokenizer(directory)
    weights = directory / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert builtin_model_dir() == directory and weights.stat().st_mtime_ns == written
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no temporary left
