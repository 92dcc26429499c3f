"""The roofline's model costs against the checkpoint itself: the weights a decode step
reads are every matrix in the file (the tied LM head once), counted from the tensors'
shapes, not from the config's arithmetic; and the ceiling moves the way the costs say."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from benchmarks.roofline import ceiling, model_costs


def test_weight_bytes_are_the_checkpoints_matrices(real_model_dir: Path) -> None:
    config = json.loads((real_model_dir / "config.json").read_text())
    cost = model_costs(config)
    matrices = 0
    with safe_open(str(real_model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2:  # norms are vectors: read, but a rounding error here
                matrices += shape[0] * shape[1]
    assert cost["weight_bytes"] == 4 * matrices
    vocab_h = config["vocab_size"] * config["hidden_size"]
    assert cost["linear_params"] == matrices - vocab_h  # the embedding is the LM head
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    assert cost["kv_bytes_per_token"] == layers * 2 * kv_heads * config["head_dim"] * 4


def test_the_ceiling_rises_with_streams_and_falls_with_context(real_model_dir: Path) -> None:
    cost = model_costs(json.loads((real_model_dir / "config.json").read_text()))
    rates = {"flops_per_s": 1e11, "read_bytes_per_s": 1e10}
    shape, longer = (128, 384, 128), (128, 1024, 128)
    by_streams = [ceiling(cost, rates, shape, c)["ceiling_output_tok_s"] for c in (1, 16, 64)]
    assert by_streams == sorted(by_streams)
    assert ceiling(cost, rates, longer, 16)["ceiling_output_tok_s"] < by_streams[1]
    # One stream: its decode reads every weight per token, whatever the prompt.
    one = ceiling(cost, rates, shape, 1)
    assert one["decode_ms_per_output_token"] > cost["weight_bytes"] / 1e10 * 1e3


def test_the_serial_ceiling_adds_the_kv_read_to_the_products(real_model_dir: Path) -> None:
    cost = model_costs(json.loads((real_model_dir / "config.json").read_text()))
    rates = {"flops_per_s": 1e11, "read_bytes_per_s": 1e10}
    context = 128 + 384 + 128 / 2
    for streams in (1, 16, 64):
        cell = ceiling(cost, rates, (128, 384, 128), streams)
        products = 2 * (cost["head_params"] + cost["linear_params"])
        products += context * cost["attn_flops_per_pair"]
        weights_ms = cost["weight_bytes"] / streams / 1e10 * 1e3
        kv_ms = context * cost["kv_bytes_per_token"] / 1e10 * 1e3
        want = max(products / 1e11 * 1e3, weights_ms) + kv_ms
        assert abs(cell["decode_serial_ms_per_output_token"] - want) < 1e-9
        assert cell["ceiling_serial_output_tok_s"] <= cell["ceiling_output_tok_s"]
