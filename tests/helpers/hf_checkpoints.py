"""Tiny random Hugging Face checkpoints (float32, safetensors): the tests' oracle models."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from worker.model_config import ModelConfig, parse_model_config

VOCAB = 160

# Weights drawn with std 0.2 instead of transformers' 0.02. At 0.02 attention is nearly
# uniform (largest weight 0.054 where a uniform split gives 0.050), so an attention bug
# barely moves the logits: zeroing o_proj changed 1 greedy token in 180 for Llama. At 0.2
# the largest weight averages ~0.6: peaked, yet not one-hot (a scale or window bug still
# moves weight between keys), and the greedy paths' top-2 logit margins stay far above
# float noise (hf_greedy checks them).
INIT_STD = 0.2

COMMON = dict(
    initializer_range=INIT_STD,
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

# Gemma 3's 5:1 sliding/full mix with a window far shorter than the prompts; a score scale
# (24 ** -0.5) that is not head_dim ** -0.5; local and global RoPE bases of their own,
# the global one linearly scaled; biases on the attention projections.
GEMMA3 = dict(
    COMMON,
    num_hidden_layers=6,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=6,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    attention_bias=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
    },
)

CHECKPOINTS = {
    # llama3 rope scaling with a short original context, so all three frequency bands
    # (kept, scaled, blended) are exercised; biases on every attention projection.
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **COMMON,
            num_hidden_layers=2,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**COMMON, num_hidden_layers=3, tie_word_embeddings=True)
    ),
    # Interleaved sliding-window and full-attention layers (two KV cache groups), as
    # transformers' Qwen2 runs them from `layer_types`.
    "qwen2_interleaved": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **COMMON,
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    ),
    # Five sliding-window layers per full-attention layer (the Gemma 3 mix): six KV cache
    # groups of one layer each, sharing one buffer.
    "qwen2_5to1": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **COMMON,
            num_hidden_layers=6,
            use_sliding_window=True,
            sliding_window=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )
    ),
    # A window much shorter than the prompts, and head_dim * heads != hidden_size.
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, num_hidden_layers=2, head_dim=32, sliding_window=6)
    ),
    # head_dim 128, the size the CUDA kernels are tuned for, with a GQA group of 2.
    "llama_d128": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, num_hidden_layers=2, head_dim=128)
    ),
    # Per-head q/k RMSNorm before RoPE, no biases, head_dim * heads != hidden_size.
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**COMMON, num_hidden_layers=3, head_dim=32)
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)),
    "gemma3_softcap": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**GEMMA3, final_logit_softcapping=3.0)
    ),
}


def save_checkpoint(name: str, path: Path) -> torch.nn.Module:
    torch.manual_seed(1234)
    hf_model = CHECKPOINTS[name]().float().eval()
    with torch.no_grad():
        # transformers initialises biases to 0 and norms to the identity; perturb them
        # so a misplaced bias or norm weight shows up in the logits. Gemma's norms scale
        # by 1 + weight: their identity is 0.
        norm_identity = 0.0 if hf_model.config.model_type.startswith("gemma") else 1.0
        for pname, p in hf_model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in pname:
                p.copy_(norm_identity + 0.1 * torch.randn_like(p))
    hf_model.config.architectures = [type(hf_model).__name__]
    hf_model.save_pretrained(path)
    hf_model.config._attn_implementation = "eager"
    return hf_model


# Greedy continuations used as oracles must not hinge on float noise: at every step the
# chosen token leads the runner-up by at least twice the logit tolerance of the logit tests
# (1e-4), so an engine whose logits pass those cannot pick another token.
MIN_GREEDY_MARGIN = 2e-4


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of prompt: exactly n tokens, EOS ignored.
    Fails if any step's top-2 logit margin is below MIN_GREEDY_MARGIN."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    step = int(margins.argmin())
    assert margins[step] >= MIN_GREEDY_MARGIN, (
        f"oracle too close to call: step {step} of prompt {prompt} has a top-2 logit margin "
        f"of {float(margins[step]):.2e}; change the prompt or the checkpoint seed"
    )
    return out.sequences[0, len(prompt) :].tolist()


def small_model_config(architecture: str, **overrides: object) -> ModelConfig:
    """A two-layer config of the given architecture, parsed as a config.json would be."""
    raw = {
        "architectures": [architecture],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **overrides,
    }
    return parse_model_config(raw)
