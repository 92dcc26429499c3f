"""Our paged Llama-family model against Hugging Face transformers, the oracle.

Tiny random checkpoints are built with transformers and saved as safetensors; we load
them through load_model_config + iterate_weights and run mixed paged batches by hand
(prefill, chunked prefill, decode in one step), comparing logits at every computed
position with transformers' logits over the full sequence, and greedy tokens with
transformers' own generate().
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from protocol.kv_cache import FullAttentionSpec, SlidingWindowSpec
from tests.helpers.hf_checkpoints import CHECKPOINTS, VOCAB, hf_greedy, save_checkpoint
from worker.attention import AttentionMetadata
from worker.model_config import (
    LinearRopeScaling,
    ModelConfig,
    load_model_config,
    parse_model_config,
)
from worker.models import get_model_class
from worker.models.llama import LlamaForCausalLM
from worker.weights import iterate_weights

BLOCK_SIZE = 4
NUM_BLOCKS = 96
GEN_TOKENS = 8


@dataclass
class _Request:
    token_ids: list[int]
    num_computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # per group
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits
    generated: list[int] = field(default_factory=list)


class _PagedHarness:
    """Plays the scheduler and model runner: block allocation, metadata, one forward."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, num_groups: int) -> None:
        self.model = model
        self.num_groups = num_groups
        # Alternate layers between groups, as the runner would from a KVCacheConfig with
        # several groups; each group allocates from its own disjoint set of block ids.
        for i, layer in enumerate(model.attention_layers().values()):
            layer.kv_group = i % num_groups
        shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        # NaN everywhere not written this run: reading a stale slot poisons the logits.
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan")))
            for _ in range(config.num_hidden_layers)
        ]
        rng = random.Random(99)
        self.free = []
        for g in range(num_groups):
            # Block 0 is the null block; shuffled so tables are not contiguous.
            ids = [i for i in range(1, NUM_BLOCKS) if i % num_groups == g]
            rng.shuffle(ids)
            self.free.append(ids)

    def check_layers_wrote_only_their_group_blocks(self) -> None:
        for i, (key_cache, value_cache) in enumerate(self.kv_caches):
            written = torch.nonzero(~key_cache.isnan().all(dim=(1, 2, 3))).flatten()
            assert all(int(b) % self.num_groups == i % self.num_groups for b in written), i
            assert torch.equal(key_cache.isnan(), value_cache.isnan()), i

    def step(self, scheduled: list[tuple[_Request, int]]) -> None:
        """Compute `n` new tokens of each (request, n); record logits; sample greedily."""
        input_ids, positions, qsl, seq_lens = [], [], [0], []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        for req, n in scheduled:
            start, end = req.num_computed, req.num_computed + n
            if not req.blocks:
                req.blocks = [[] for _ in range(self.num_groups)]
            for g in range(self.num_groups):
                while len(req.blocks[g]) < math.ceil(end / BLOCK_SIZE):
                    req.blocks[g].append(self.free[g].pop())
                for p in range(start, end):
                    block = req.blocks[g][p // BLOCK_SIZE]
                    slots[g].append(block * BLOCK_SIZE + p % BLOCK_SIZE)
            input_ids += req.token_ids[start:end]
            positions += list(range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
        # Two padding tokens at the end, as a runner padding to a graph size would add.
        input_ids += [0, 0]
        positions += [0, 0]
        for g in range(self.num_groups):
            slots[g] += [-1, -1]

        max_blocks = max(len(req.blocks[0]) for req, _ in scheduled) + 2
        tables = []
        for g in range(self.num_groups):
            table = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
            for b, (req, _) in enumerate(scheduled):
                table[b, : len(req.blocks[g])] = torch.tensor(req.blocks[g], dtype=torch.int32)
            tables.append(table)
        attn = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mappings=[torch.tensor(s, dtype=torch.int64) for s in slots],
        )
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(input_ids), torch.tensor(positions), attn, self.kv_caches
            )
            logits = self.model.compute_logits(hidden[: qsl[-1]])
        assert logits.dtype == torch.float32 and logits.shape == (qsl[-1], VOCAB)
        for b, (req, n) in enumerate(scheduled):
            for i in range(n):
                req.logits[req.num_computed + i] = logits[qsl[b] + i]
            req.num_computed += n
            if req.num_computed == len(req.token_ids):  # prompt done or decode: sample
                token = int(logits[qsl[b + 1] - 1].argmax())
                req.generated.append(token)
                req.token_ids.append(token)


def _load(path: Path) -> tuple[LlamaForCausalLM, ModelConfig]:
    config = load_model_config(path)
    model = get_model_class(config.architecture)(config, torch.float32, torch.device("cpu"))
    model.load_weights(iterate_weights(path))
    return model, config


PROMPT_LENS = {"a": 11, "b": 5, "c": 17, "d": 14}


def paged_prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    return {
        k: torch.randint(3, VOCAB, (n,), generator=gen).tolist() for k, n in PROMPT_LENS.items()
    }


def run_paged_batches(harness: _PagedHarness, prompts: dict[str, list[int]]) -> dict[str, _Request]:
    """Step 1: three whole prompts and the first chunk of d; later steps decode a, b, c
    while d's prefill continues in chunks, then d decodes alongside them."""
    reqs = {k: _Request(list(p)) for k, p in prompts.items()}
    a, b, c, d = reqs["a"], reqs["b"], reqs["c"], reqs["d"]
    harness.step([(a, 11), (b, 5), (d, 6), (c, 17)])
    harness.step([(d, 5), (a, 1), (b, 1), (c, 1)])
    harness.step([(a, 1), (d, 3), (b, 1), (c, 1)])
    while len(d.generated) < GEN_TOKENS:
        batch = [(r, 1) for r in (a, b, c) if len(r.generated) < GEN_TOKENS]
        harness.step([*batch, (d, 1)])
    harness.check_layers_wrote_only_their_group_blocks()
    return reqs


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_paged_batches_match_transformers(name: str, tmp_path: Path) -> None:
    hf_model = save_checkpoint(name, tmp_path)
    model, config = _load(tmp_path)
    harness = _PagedHarness(model, config, num_groups=2 if name == "qwen2" else 1)

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
    llama_cfg = _small_config("LlamaForCausalLM")
    llama = LlamaForCausalLM(llama_cfg, torch.float32, torch.device("cpu"))
    assert llama.kv_cache_specs(4, "float16") == {
        f"model.layers.{i}.self_attn": FullAttentionSpec(4, 2, 16, "float16") for i in range(2)
    }


# ---- loading errors: every message names what is wrong and where ------------------------


def _small_config(architecture: str, **overrides: object) -> ModelConfig:
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


def test_config_defaults_and_legacy_rope_fields() -> None:
    cfg = _small_config("LlamaForCausalLM", rope_theta=500000.0, eos_token_id=[7, 9])
    assert cfg.head_dim == 16 and cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (7, 9) and cfg.sliding_windows == (None, None)
    legacy = _small_config(
        "LlamaForCausalLM",
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
    )
    assert legacy.rope_theta == 500000.0
    assert legacy.rope_scaling is not None and legacy.rope_scaling.factor == 8.0
    assert legacy.rope_scaling.original_max_position_embeddings == 256
    qwen = _small_config(
        "Qwen2ForCausalLM",
        use_sliding_window=True,
        sliding_window=32,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.sliding_windows == (None, 32)
    assert _small_config("Qwen2ForCausalLM", sliding_window=32).sliding_windows == (None, None)
    assert _small_config("MistralForCausalLM", eos_token_id=2).eos_token_ids == (2,)


def test_qwen3_config() -> None:
    # transformers' Qwen3 default head_dim is 128 whatever hidden_size / heads is.
    qwen3 = _small_config("Qwen3ForCausalLM")
    assert qwen3.head_dim == 128 and qwen3.qk_norm and qwen3.hidden_act == "silu"
    assert not qwen3.qkv_bias and not qwen3.o_proj_bias and qwen3.sliding_windows == (None, None)
    biased = _small_config(
        "Qwen3ForCausalLM",
        head_dim=16,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    assert biased.head_dim == 16 and biased.qkv_bias and biased.o_proj_bias
    assert biased.sliding_windows == (None, 8) and biased.attention_scale == 16**-0.5


def test_gemma3_config_from_transformers_4_fields() -> None:
    """Hub configs written before transformers 5: a sliding_window_pattern instead of
    layer_types, rope_theta/rope_scaling for global layers, rope_local_base_freq for
    local ones; and transformers' Gemma 3 defaults where a field is absent."""
    cfg = _small_config(
        "Gemma3ForCausalLM",
        num_hidden_layers=6,
        sliding_window_pattern=3,
        sliding_window=512,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        final_logit_softcapping=30.0,
    )
    assert cfg.sliding_windows == (512, 512, None, 512, 512, None)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == LinearRopeScaling(8.0)
    assert cfg.sliding_rope_theta == 1e4 and cfg.final_logit_softcapping == 30.0
    assert cfg.head_dim == 256 and cfg.attention_scale == 256**-0.5
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.hidden_act == "gelu_pytorch_tanh"
    default = _small_config("Gemma3ForCausalLM", num_hidden_layers=7, head_dim=16)
    assert default.sliding_windows == (4096,) * 5 + (None, 4096)
    assert (default.rope_theta, default.sliding_rope_theta) == (1e6, 1e4)
    assert default.rope_scaling is None and default.final_logit_softcapping is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"rope_parameters": {"rope_theta": 1e4}}, "rope_parameters must map"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "sliding_attention",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear"}}},
            "full_attention rope_parameters needs a positive factor",
        ),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ],
)
def test_gemma3_config_rejects(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _small_config("Gemma3ForCausalLM", **overrides)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (None, "missing"),
        ("{not json", "malformed JSON"),
        (json.dumps({"architectures": ["GPT2LMHeadModel"]}), "LlamaForCausalLM"),
        (json.dumps({"architectures": ["LlamaForCausalLM"]}), "'hidden_size'"),
    ],
)
def test_config_file_errors(tmp_path: Path, contents: str | None, message: str) -> None:
    if contents is not None:
        (tmp_path / "config.json").write_text(contents)
    with pytest.raises(ValueError, match=message) as info:
        load_model_config(tmp_path)
    assert "config.json" in str(info.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_model_config(tmp_path / "nope")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"num_attention_heads": 5}, "not divisible"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_config_rejects_nonsense(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _small_config("LlamaForCausalLM", **overrides)


def test_weight_errors_name_the_file_or_tensor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("no *.safetensors")):
        list(iterate_weights(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ValueError, match=re.escape("model.safetensors")):
        list(iterate_weights(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match=re.escape("model-00002-of-00002.safetensors")):
        list(iterate_weights(tmp_path))

    model = LlamaForCausalLM(_small_config("LlamaForCausalLM"), torch.float32, torch.device("cpu"))
    weights = dict(model.state_dict())
    with pytest.raises(ValueError, match=re.escape("missing weights: model.norm.weight")):
        model.load_weights((k, v) for k, v in weights.items() if k != "model.norm.weight")
    with pytest.raises(ValueError, match=re.escape("unexpected weight 'model.extra'")):
        model.load_weights([*weights.items(), ("model.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match=re.escape("'lm_head.weight' has shape")):
        model.load_weights({**weights, "lm_head.weight": torch.zeros(3, 64)}.items())
