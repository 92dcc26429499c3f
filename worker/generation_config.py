"""What a model's generation_config.json adds to its config.json: the EOS ids that end a
turn (Llama 3 Instruct lists three; its chat turns end on <|eot_id|>, not config.json's
one) and the sampling values its authors recommend, used for fields a request leaves
unset. Parsed strictly: a malformed file fails at start-up naming the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

from protocol.engine import SamplingDefaults

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "none")


def load_generation_config(
    model_dir: str | Path, mode: str = "auto"
) -> tuple[tuple[int, ...], SamplingDefaults]:
    """(EOS ids, sampling defaults) from the model directory's generation_config.json;
    none of either when the file is absent or mode is "none"."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be auto or none, not {mode!r}")
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if mode == "none" or not path.is_file():
        return (), SamplingDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")

    eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else ([] if eos is None else eos)
    if not isinstance(eos_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids
    ):
        raise ValueError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")

    defaults = SamplingDefaults()
    values = {}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float)):
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
        if not math.isfinite(value):  # JSON's Infinity and NaN, which int() cannot take
            raise ValueError(f"{path}: {name} must be a finite number, got {value!r}")
        if kind is int and value != int(value):
            raise ValueError(f"{path}: {name} must be an integer, got {value!r}")
        values[name] = kind(value)
    t, p, k, m = (values.get(n) for n in ("temperature", "top_p", "top_k", "min_p"))
    if t is not None and not (t >= 0.0 and math.isfinite(t)):
        raise ValueError(f"{path}: temperature must be >= 0, got {t}")
    if p is not None and not 0.0 < p <= 1.0:
        raise ValueError(f"{path}: top_p must be in (0, 1], got {p}")
    if k is not None and k < 0:
        raise ValueError(f"{path}: top_k must be >= 0, got {k}")
    if m is not None and not 0.0 <= m <= 1.0:
        raise ValueError(f"{path}: min_p must be in [0, 1], got {m}")
    if values:
        defaults = SamplingDefaults(
            temperature=defaults.temperature if t is None else t,
            top_p=defaults.top_p if p is None else p,
            top_k=defaults.top_k if k is None else k,
            min_p=defaults.min_p if m is None else m,
        )
    return tuple(dict.fromkeys(eos_ids)), defaults
