"""ModelConfig: the parts of a Hugging Face `config.json` the worker's models need.

Parsing is strict: a checkpoint the engine cannot run correctly fails at start-up with a
message naming the file and the field, rather than producing wrong tokens later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma3ForCausalLM",
)
# MLP activations by their Hugging Face names (worker.layers maps each to a function).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# transformers' own head_dim default where a family's differs from hidden / heads: a
# config.json without head_dim means this, not the quotient.
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128, "Gemma3ForCausalLM": 256}
_GEMMA3 = "Gemma3ForCausalLM"

_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency rescaling of the rotary embedding."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Positions divided by `factor` (all frequencies slowed alike), e.g. Gemma 3's global
    layers."""

    factor: float


RopeScaling = Llama3RopeScaling | LinearRopeScaling


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"  # one of SUPPORTED_ACTIVATIONS
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3), weights of size head_dim.
    qk_norm: bool = False
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim.
    query_pre_attn_scalar: float | None = None
    rope_scaling: RopeScaling | None = None
    # RoPE base of the sliding-window layers when it is not rope_theta (Gemma 3: local
    # layers 10k, global ones 1M); unscaled. None: every layer rotates alike.
    sliding_rope_theta: float | None = None
    # logits -> cap * tanh(logits / cap) before sampling (Gemma); None: no cap.
    final_logit_softcapping: float | None = None
    # One entry per layer: the window in keys (the query's own key included), or None
    # for full attention. Kept per layer so interleaved sliding/full models fit too.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window shared by the sliding layers, if any."""
        return next((w for w in self.sliding_windows if w is not None), None)

    @property
    def attention_scale(self) -> float:
        """The factor on q . k before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `model_dir/config.json`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist or is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; a Hugging Face model directory needs a config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed config.json; `source` names it in errors."""
    r = _Reader(raw, source)
    architecture = _architecture(r)

    hidden_size = r.get_int("hidden_size")
    num_heads = r.get_int("num_attention_heads")
    num_kv_heads = r.get_int("num_key_value_heads", default=num_heads)
    num_layers = r.get_int("num_hidden_layers")
    head_dim = r.get_int("head_dim", default=_DEFAULT_HEAD_DIM.get(architecture))
    if head_dim is None:
        if hidden_size % num_heads != 0:
            r.fail(
                f"hidden_size ({hidden_size}) is not divisible by num_attention_heads "
                f"({num_heads}) and no head_dim is given"
            )
        head_dim = hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        r.fail(
            f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads "
            f"({num_kv_heads})"
        )
    if head_dim % 2 != 0:
        r.fail(f"head_dim must be even for rotary embeddings, got {head_dim}")
    is_gemma3 = architecture == _GEMMA3
    # Gemma names the MLP activation hidden_activation, the others hidden_act.
    act_key = "hidden_activation" if is_gemma3 else "hidden_act"
    hidden_act = raw.get(act_key) or ("gelu_pytorch_tanh" if is_gemma3 else "silu")
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        r.fail(
            f"{act_key} {hidden_act!r} is not supported; expected one of "
            f"{list(SUPPORTED_ACTIVATIONS)}"
        )

    if is_gemma3:
        rope_theta, rope_scaling, sliding_rope_theta = _gemma3_rope(r)
    else:
        rope_theta, rope_scaling = _rope(r)
        sliding_rope_theta = None
    eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else (eos or [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_ids):
        r.fail(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype not in _DTYPES:
        r.fail(f"dtype {dtype!r} is not supported; expected one of {list(_DTYPES)}")

    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = r.get_bool("attention_bias", default=False)
    return ModelConfig(
        architecture=architecture,
        vocab_size=r.get_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=r.get_int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=r.get_float("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=r.get_int("max_position_embeddings"),
        tie_word_embeddings=r.get_bool("tie_word_embeddings", default=is_gemma3),
        # Qwen2 always has q/k/v biases and none on o_proj; elsewhere attention_bias
        # covers all four projections.
        qkv_bias=is_qwen2 or attention_bias,
        o_proj_bias=(not is_qwen2) and attention_bias,
        mlp_bias=architecture == "LlamaForCausalLM" and r.get_bool("mlp_bias", default=False),
        hidden_act=hidden_act,
        qk_norm=architecture in ("Qwen3ForCausalLM", _GEMMA3),
        query_pre_attn_scalar=(
            r.get_float("query_pre_attn_scalar", default=256.0) if is_gemma3 else None
        ),
        rope_scaling=rope_scaling,
        sliding_rope_theta=sliding_rope_theta,
        final_logit_softcapping=_gemma3_softcaps(r) if is_gemma3 else None,
        sliding_windows=_sliding_windows(r, architecture, num_layers),
        bos_token_id=r.get_int("bos_token_id", default=None, minimum=0),
        eos_token_ids=tuple(eos_ids),
        dtype=dtype,
    )


class _Reader:
    """Typed field access that names the file and the field in every error."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def fail(self, message: str) -> NoReturn:
        raise ValueError(f"{self.source}: {message}")

    _REQUIRED = object()

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is self._REQUIRED:
                self.fail(f"missing required field {key!r}")
            return default
        return value

    def get_int(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        value = self._get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"{key} must be an integer, got {value!r}")
        if value < minimum:
            self.fail(f"{key} must be >= {minimum}, got {value}")
        return value

    def get_float(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            self.fail(f"{key} must be a positive number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            self.fail(f"{key} must be true or false, got {value!r}")
        return value


def _architecture(r: _Reader) -> str:
    archs = r.raw.get("architectures")
    if not archs or not isinstance(archs, list):
        r.fail(f"missing 'architectures'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        r.fail(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(r: _Reader) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older
    # checkpoints have a top-level rope_theta and an optional `rope_scaling`.
    params = r.raw.get("rope_parameters") or r.raw.get("rope_scaling") or {}
    return _rope_params(r, params, r.raw.get("rope_theta", 10000.0), "rope_parameters")


def _gemma3_rope(r: _Reader) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta): Gemma 3 rotates its sliding-window
    layers with their own, unscaled base."""
    params = r.raw.get("rope_parameters")
    if params is None:
        # Before transformers 5: rope_theta and rope_scaling for the global layers,
        # rope_local_base_freq for the local ones.
        full = dict(r.raw.get("rope_scaling") or {})
        sliding = {"rope_theta": r.raw.get("rope_local_base_freq", 10000.0)}
    else:
        known = {"full_attention", "sliding_attention"}
        if not isinstance(params, dict) or not set(params) <= known:
            r.fail(f"rope_parameters must map {sorted(known)} to RoPE settings, got {params!r}")
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention") or {}
    theta, scaling = _rope_params(
        r, full, r.raw.get("rope_theta", 1_000_000.0), "full_attention rope_parameters"
    )
    local_theta, local_scaling = _rope_params(
        r, sliding, 10000.0, "sliding_attention rope_parameters"
    )
    if local_scaling is not None:
        r.fail("scaled RoPE on sliding_attention layers is not supported")
    return theta, scaling, local_theta


def _rope_params(
    r: _Reader, params: Any, default_theta: Any, what: str
) -> tuple[float, RopeScaling | None]:
    """One RoPE settings object: its theta and frequency scaling; `what` names it."""
    if not isinstance(params, dict):
        r.fail(f"{what} must be an object, got {params!r}")
    theta = params.get("rope_theta", default_theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        r.fail(f"rope_theta must be a positive number, got {theta!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        r.fail("partial_rotary_factor other than 1.0 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            r.fail(f"linear rope scaling in {what} needs a positive factor, got {factor!r}")
        return float(theta), LinearRopeScaling(float(factor))
    if rope_type != "llama3":
        r.fail(
            f"rope type {rope_type!r} in {what} is not supported "
            "(only 'default', 'linear' and 'llama3')"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", r.raw["max_position_embeddings"])
            ),
        )
    except KeyError as e:
        r.fail(f"llama3 rope scaling is missing field {e.args[0]!r}")
    except (TypeError, ValueError) as e:
        r.fail(f"llama3 rope scaling has a non-numeric field: {e}")
    if scaling.high_freq_factor <= scaling.low_freq_factor or scaling.factor <= 0:
        r.fail(f"llama3 rope scaling needs factor > 0 and high > low freq factor: {params}")
    return float(theta), scaling


def _gemma3_softcaps(r: _Reader) -> float | None:
    """The final-logit cap. transformers' Gemma 3 never applies attn_logit_softcapping
    (its attention drops the setting), so a config that sets it has no reference output
    to match: refused rather than guessed."""
    attn_cap = r.raw.get("attn_logit_softcapping")
    if attn_cap is not None:
        r.fail(
            f"attn_logit_softcapping is {attn_cap!r}, but Gemma 3 as transformers runs it "
            "ignores it; set it to null to run the model as transformers does"
        )
    return r.get_float("final_logit_softcapping", default=None)


def _sliding_windows(r: _Reader, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    if architecture == "LlamaForCausalLM":
        return (None,) * num_layers
    if architecture == "MistralForCausalLM":
        # Mistral applies its window (when set) to every layer.
        return (r.get_int("sliding_window", default=None),) * num_layers
    if architecture == _GEMMA3:
        if r.get_bool("use_bidirectional_attention", default=False):
            r.fail("use_bidirectional_attention is not supported: the engine attends causally")
        layer_types = r.raw.get("layer_types")
        if layer_types is None:
            # Older configs give a period instead: every n-th layer (1-based) is global.
            period = r.get_int("sliding_window_pattern", default=6)
            layer_types = [
                "full_attention" if (i + 1) % period == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        return _windows_by_layer_type(r, layer_types, r.get_int("sliding_window", 4096), num_layers)
    # Qwen2 and Qwen3 ignore sliding_window unless use_sliding_window is true, and then
    # only on layers marked "sliding_attention" (by default those at index >=
    # max_window_layers).
    if not r.get_bool("use_sliding_window", default=False):
        return (None,) * num_layers
    window = r.get_int("sliding_window")
    layer_types = r.raw.get("layer_types")
    if layer_types is None:
        first = r.get_int("max_window_layers", default=num_layers, minimum=0)
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    return _windows_by_layer_type(r, layer_types, window, num_layers)


def _windows_by_layer_type(
    r: _Reader, layer_types: Any, window: int, num_layers: int
) -> tuple[int | None, ...]:
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        r.fail(f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
    known = ("sliding_attention", "full_attention")
    for t in layer_types:
        if t not in known:
            r.fail(f"layer type {t!r} is not supported; expected one of {list(known)}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
