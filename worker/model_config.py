"""ModelConfig: the parts of a Hugging Face `config.json` the worker's models need.

Parsing is strict: a checkpoint the engine cannot run correctly fails at start-up with a
message naming the file and the field, rather than producing wrong tokens later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency rescaling of the rotary embedding."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: Llama3RopeScaling | None = None
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
    head_dim = r.get_int("head_dim", default=None)
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
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        r.fail(f"hidden_act {hidden_act!r} is not supported (only 'silu')")

    rope_theta, rope_scaling = _rope(r)
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
        tie_word_embeddings=r.get_bool("tie_word_embeddings", default=False),
        # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias
        # covers all four projections.
        qkv_bias=is_qwen2 or attention_bias,
        o_proj_bias=(not is_qwen2) and attention_bias,
        mlp_bias=architecture == "LlamaForCausalLM" and r.get_bool("mlp_bias", default=False),
        rope_scaling=rope_scaling,
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

    def get_float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._get(key, default)
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


def _rope(r: _Reader) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older
    # checkpoints have a top-level rope_theta and an optional `rope_scaling`.
    params = r.raw.get("rope_parameters") or r.raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        r.fail(f"rope_parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", r.raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        r.fail(f"rope_theta must be a positive number, got {theta!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        r.fail("partial_rotary_factor other than 1.0 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        r.fail(f"rope type {rope_type!r} is not supported (only 'default' and 'llama3')")
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


def _sliding_windows(r: _Reader, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    if architecture == "LlamaForCausalLM":
        return (None,) * num_layers
    if architecture == "MistralForCausalLM":
        # Mistral applies its window (when set) to every layer.
        return (r.get_int("sliding_window", default=None),) * num_layers
    # Qwen2 ignores sliding_window unless use_sliding_window is true, and then only on
    # layers marked "sliding_attention" (by default those at index >= max_window_layers).
    if not r.get_bool("use_sliding_window", default=False):
        return (None,) * num_layers
    window = r.get_int("sliding_window")
    layer_types = r.raw.get("layer_types")
    if layer_types is None:
        first = r.get_int("max_window_layers", default=num_layers, minimum=0)
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        r.fail(f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
    known = ("sliding_attention", "full_attention")
    for t in layer_types:
        if t not in known:
            r.fail(f"layer type {t!r} is not supported; expected one of {list(known)}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
