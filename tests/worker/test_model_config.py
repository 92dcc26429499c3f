"""worker/model_config.py: a Hugging Face config.json read into a ModelConfig, with each
architecture's defaults, legacy field spellings, and an error naming what is wrong and where."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.hf_checkpoints import small_model_config
from worker.model_config import LinearRopeScaling, load_model_config


def test_config_defaults_and_legacy_rope_fields() -> None:
    cfg = small_model_config("LlamaForCausalLM", rope_theta=500000.0, eos_token_id=[7, 9])
    assert cfg.head_dim == 16 and cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (7, 9) and cfg.sliding_windows == (None, None)
    legacy = small_model_config(
        "LlamaForCausalLM",
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
    )
    assert legacy.rope_theta == 500000.0
    assert legacy.rope_scaling is not None and legacy.rope_scaling.factor == 8.0
    assert legacy.rope_scaling.original_max_position_embeddings == 256
    qwen = small_model_config(
        "Qwen2ForCausalLM",
        use_sliding_window=True,
        sliding_window=32,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.sliding_windows == (None, 32)
    assert small_model_config("Qwen2ForCausalLM", sliding_window=32).sliding_windows == (None, None)
    assert small_model_config("MistralForCausalLM", eos_token_id=2).eos_token_ids == (2,)


def test_qwen3_config() -> None:
    # transformers' Qwen3 default head_dim is 128 whatever hidden_size / heads is.
    qwen3 = small_model_config("Qwen3ForCausalLM")
    assert qwen3.head_dim == 128 and qwen3.qk_norm and qwen3.hidden_act == "silu"
    assert not qwen3.qkv_bias and not qwen3.o_proj_bias and qwen3.sliding_windows == (None, None)
    biased = small_model_config(
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
    cfg = small_model_config(
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
    default = small_model_config("Gemma3ForCausalLM", num_hidden_layers=7, head_dim=16)
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
        small_model_config("Gemma3ForCausalLM", **overrides)


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
        small_model_config("LlamaForCausalLM", **overrides)
