"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

The four architectures differ only in configuration, which ModelConfig already
resolves: Qwen2 has q/k/v biases and may tie its LM head to the embedding; Qwen3 norms
q and k per head before RoPE; Mistral attends through a sliding window on every layer.
Other families (worker.models.gemma3) reuse the attention and the causal-LM shell here
with their own decoder layer. Parameter names match Hugging Face checkpoints so weights
copy across by name; under tensor parallelism (worker.parallel) each rank builds only its
shard and slices it out of the full checkpoint tensors.

Sliding-window convention (checked in transformers 5.24, masking_utils
`sliding_window_overlay`: key kv_idx is visible to query q_idx iff
kv_idx > q_idx - sliding_window, on top of the causal kv_idx <= q_idx): a query at
position p sees keys p - W + 1 .. p, i.e. W keys counting itself. That is exactly the
meaning of `sliding_window` in pagedkernels.reference.paged_attention and in
protocol.kv_cache.SlidingWindowSpec, so config.json's value is passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedkernels.cpu_elementwise import CpuElementwise
from pagedkernels.selection import AttentionKernels, select_kernels
from protocol.kv_cache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from worker.attention import AttentionMetadata
from worker.layers import (
    ColumnParallelLinear,
    GatedMLP,
    Linear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    stack_linears,
)
from worker.model_config import ModelConfig
from worker.parallel import TPContext, load_shard, shard_heads, shard_vocab

KVCache = tuple[torch.Tensor, torch.Tensor]

# Present in some older checkpoints; we recompute it, so it is neither loaded nor missing.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        sliding_window: int | None,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext,
        qk_norm: type[RMSNorm] | None = None,
        kernels: AttentionKernels | None = None,
    ) -> None:
        """qk_norm: the norm applied to each q and k head before RoPE, if any; kernels: the
        worker's choice (None: select_kernels' default)."""
        super().__init__()
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        # Local counts: this rank's query heads and the KV heads they read, which is also
        # what its KV cache holds.
        self.num_heads = heads.q_heads.size
        self.num_kv_heads = heads.kv_heads.size
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = sliding_window
        # Which KV cache group's block table and slot mapping this layer reads; the
        # runner sets it from the KVCacheConfig the core sends.
        self.kv_group = 0
        self.kernels = kernels or select_kernels(device, dtype, self.head_dim)
        hidden, bias = config.hidden_size, config.qkv_bias
        q_rows = heads.q_heads.scaled(self.head_dim)
        kv_rows = heads.kv_heads.scaled(self.head_dim)
        self.q_proj = ColumnParallelLinear(hidden, q_rows, bias, dtype, device)
        self.k_proj = ColumnParallelLinear(hidden, kv_rows, bias, dtype, device)
        self.v_proj = ColumnParallelLinear(hidden, kv_rows, bias, dtype, device)
        self.o_proj = RowParallelLinear(q_rows, hidden, config.o_proj_bias, dtype, device, tp)
        # Over head_dim, so the same weights on every rank (replicated, not sharded).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        # The C kernels, set by the runner on float32 CPU models (pagedkernels.cpu_elementwise).
        self.native: CpuElementwise | None = None
        self.qkv_proj: Linear | None = None  # fuse_projections()
        self.qkv_sizes = (q_rows.size, kv_rows.size, kv_rows.size)
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps, dtype, device)

    def fuse_projections(self) -> None:
        """From now on q, k and v are one product (their weights stacked); the three
        modules are released."""
        self.qkv_proj = stack_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.native is not None:
            q, k = self.native.rope_(q, cos, sin), self.native.rope_(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        key_cache, value_cache = kv_cache
        self.kernels.write_kv_cache(k, v, key_cache, value_cache, attn.slot_mappings[self.kv_group])
        out = self.kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            attn.block_tables[self.kv_group],
            attn.query_start_loc,
            attn.seq_lens,
            self.scale,
            sliding_window=self.sliding_window,
        )
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
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
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(
            config,
            config.sliding_windows[layer_idx],
            dtype=dtype,
            device=device,
            tp=tp,
            qk_norm=RMSNorm if config.qk_norm else None,
            kernels=kernels,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
            dtype,
            device,
            tp,
            config.hidden_act,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        h, x = self.post_attention_layernorm.add_forward(h, x)
        return x + self.mlp(h)


DecoderLayer = Callable[
    [ModelConfig, int, torch.dtype, torch.device, TPContext, AttentionKernels | None], nn.Module
]


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext,
        decoder_layer: DecoderLayer,
        norm: type[RMSNorm],
        kernels: AttentionKernels | None = None,
    ) -> None:
        super().__init__()
        vocab = shard_vocab(config.vocab_size, tp)
        self.embed_tokens = VocabParallelEmbedding(vocab, config.hidden_size, dtype, device, tp)
        self.layers = nn.ModuleList(
            decoder_layer(config, i, dtype, device, tp, kernels)
            for i in range(config.num_hidden_layers)
        )
        self.norm = norm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    # What a family built on this shell swaps: the decoder layer (its forward takes
    # x, cos, sin, attn, kv_cache and has a `self_attn` LlamaAttention) and the final norm.
    decoder_layer: DecoderLayer = LlamaDecoderLayer
    final_norm: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext | None = None,
        kernels: AttentionKernels | None = None,
    ) -> None:
        """tp: this rank's tensor-parallel context; None builds the whole model. kernels:
        the attention kernels every layer runs (None: select_kernels' default)."""
        super().__init__()
        tp = tp or TPContext()
        if len(config.sliding_windows) != config.num_hidden_layers:
            raise ValueError(
                f"ModelConfig.sliding_windows has {len(config.sliding_windows)} entries for "
                f"{config.num_hidden_layers} layers"
            )
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.model = LlamaModel(
            config, dtype, device, tp, self.decoder_layer, self.final_norm, kernels
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, device
        )
        # Sliding-window layers rotate with their own base where the config gives one.
        self.sliding_rotary: RotaryEmbedding | None = None
        if config.sliding_rope_theta is not None:
            self.sliding_rotary = RotaryEmbedding(
                config.head_dim, config.sliding_rope_theta, None, device
            )
        self.lm_head = ParallelLMHead(
            shard_vocab(config.vocab_size, tp), config.hidden_size, dtype, device, tp
        )
        if config.tie_word_embeddings:
            # One shared Parameter: named_parameters() then lists it once, under the
            # embedding's name, which is the name checkpoints store it under. Both hold
            # the same vocabulary slice, so the tie survives sharding.
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> dict[str, LlamaAttention]:
        """Attention modules by layer name (the keys of kv_cache_specs)."""
        return {
            f"model.layers.{i}.self_attn": layer.self_attn
            for i, layer in enumerate(self.model.layers)
        }

    def kv_cache_specs(self, block_size: int, kv_dtype: str) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        for name, layer in self.attention_layers().items():
            if layer.sliding_window is None:
                specs[name] = FullAttentionSpec(
                    block_size, layer.num_kv_heads, layer.head_dim, kv_dtype
                )
            else:
                specs[name] = SlidingWindowSpec(
                    block_size, layer.num_kv_heads, layer.head_dim, kv_dtype, layer.sliding_window
                )
        return specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters by name; every parameter must be set.

        Tensors are the full, unsharded checkpoint ones; each parameter takes its rank's
        part (and shapes are checked against the full tensor, so errors name the
        checkpoint's shape whatever the tensor-parallel size).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                # Some tied checkpoints store a copy of the embedding anyway; the
                # embedding is authoritative.
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            load_shard(param, name, tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing)}")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flat batch of T tokens."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        x = self.embed(input_ids)
        full = self.rotary(positions, x.dtype)
        sliding = full if self.sliding_rotary is None else self.sliding_rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            cos, sin = full if layer.self_attn.sliding_window is None else sliding
            x = layer(x, cos, sin, attn, kv_cache)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, hidden] (the whole vector on every rank)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the selected hidden states [N, hidden]; the full
        vocabulary on every rank."""
        return self.lm_head(hidden)
