"""The built-in model: a small Llama with fixed-seed random weights and a byte tokenizer.

Written once into a cache directory as an ordinary Hugging Face model directory
(config.json + model.safetensors), so it goes through exactly the same loading path as
any real checkpoint, and runs offline.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from protocol import envs
from worker.structured_output import BYTE_TOKENIZER_FILE

NAME = "builtin-tiny-llama-v1"
SEED = 1234
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,  # 256 bytes, BOS 256, EOS 257, then padding
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


def cache_root() -> Path:
    return envs.cache_root()


def builtin_model_dir() -> Path:
    """The built-in model's directory, written on first use (atomically)."""
    target = cache_root() / NAME
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=NAME + ".", dir=target.parent))
    try:
        _write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(directory: Path) -> None:
    write_llama_checkpoint(directory, CONFIG, SEED, std=0.16)  # large weights: livelier text
    (directory / BYTE_TOKENIZER_FILE).write_text(
        json.dumps({"type": "byte", "bos_token_id": 256, "eos_token_id": 257})
    )


def write_llama_checkpoint(directory: Path, config: dict, seed: int, std: float = 0.02) -> None:
    """A Hugging Face Llama directory with normal(0, std) weights drawn from seed."""
    import torch
    from safetensors.torch import save_file

    c = config
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim", hidden // c["num_attention_heads"])
    q_out = c["num_attention_heads"] * head_dim
    kv_out = c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(q_out, hidden),
            p + "self_attn.k_proj.weight": w(kv_out, hidden),
            p + "self_attn.v_proj.weight": w(kv_out, hidden),
            p + "self_attn.o_proj.weight": w(hidden, q_out),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    if not c.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = w(c["vocab_size"], hidden)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(c, indent=2))
