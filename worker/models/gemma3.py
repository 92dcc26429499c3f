"""Gemma 3 text decoder (Gemma3ForCausalLM, config model_type gemma3_text) over a paged
KV cache.

It reuses the Llama family's attention, gated MLP, KV cache specs, weight loading and
LM head (worker.models.llama); what differs is resolved by ModelConfig (q/k norms,
query_pre_attn_scalar, GeGLU, a RoPE base of its own for the sliding-window layers,
linear RoPE scaling on the global ones) or lives here:
- embeddings are multiplied by sqrt(hidden_size) rounded to the model's dtype, as
  transformers does (in bfloat16, sqrt(3072) = 55.43 becomes 55.5);
- every norm is a GemmaRMSNorm (weight stored as an offset from 1), and each layer norms
  four times: the attention and the MLP are each wrapped in a pre- and a post-norm, the
  residual added after the post-norm;
- final logits may be soft-capped: cap * tanh(logits / cap).
Its 5:1 sliding/full layers report SlidingWindowSpec and FullAttentionSpec like any
other, so the core's hybrid KV manager frees the sliding layers' old blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkernels.selection import AttentionKernels
from worker.attention import AttentionMetadata
from worker.layers import GatedMLP, GemmaRMSNorm
from worker.model_config import ModelConfig
from worker.models.llama import KVCache, LlamaAttention, LlamaForCausalLM
from worker.parallel import TPContext


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext,
        kernels: AttentionKernels | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = LlamaAttention(
            config,
            config.sliding_windows[layer_idx],
            dtype=dtype,
            device=device,
            tp=tp,
            qk_norm=GemmaRMSNorm,
            kernels=kernels,
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = GatedMLP(
            hidden, config.intermediate_size, False, dtype, device, tp, config.hidden_act
        )
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer
    final_norm = GemmaRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext | None = None,
        kernels: AttentionKernels | None = None,
    ) -> None:
        super().__init__(config, dtype, device, tp, kernels)
        # A buffer in the model's dtype, not a Python float: the scale is rounded to the
        # dtype before the product, which is what the checkpoint was trained with.
        self.register_buffer(
            "embed_scale",
            torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device),
            persistent=False,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # After the embedding's all-reduce: each id's row comes from one rank and the
        # others add zeros, so scaling the sum is exact.
        return super().embed(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
