"""The Serve application's arguments are `pagedserve serve`'s flags, checked by the same
parser: a bad one fails where the application is built, naming it."""

from __future__ import annotations

import pytest

from launch.serve_app.app_args import parse_app_args


def test_flags_keep_the_command_lines_defaults_and_serve_options_pass_through() -> None:
    app = parse_app_args(
        {
            "model": None,
            "tensor_parallel_size": "1",
            "device": "cpu",
            "served_model_name": ["tiny", "alias"],
            "num_replicas": 2,
            "autoscaling_config": None,
            "max_load_imbalance": "3",
        }
    )
    assert app.engine["block_size"] == 16 and app.engine["tensor_parallel_size"] == 1
    assert app.model_names == ["tiny", "alias"]
    assert app.deployment == {"num_replicas": 2, "autoscaling_config": None}
    assert app.prefix_aware_routing and app.max_load_imbalance == 3
    # Every replica hashes blocks from one secret, made once where the app is built.
    assert len(app.engine["prefix_cache_hash_seed"]) == 32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param({"tensor_parallel_size": 0}, "--tensor-parallel-size", id="bad-value"),
        pytest.param({"no_such_flag": 1}, "unrecognized arguments: --no-such-flag", id="unknown"),
        pytest.param({"port": 9000}, "port does not apply under Ray Serve", id="http-port"),
        pytest.param({"prefix_cache_hash_seed": "s"}, "prefix_cache_hash_seed_file", id="seed"),
        pytest.param({"max_waiting_requests": -1}, "max-waiting-requests must be >= 0", id="neg"),
        pytest.param({"max_load_imbalance": "x"}, "max_load_imbalance must be an integer", id="lb"),
        pytest.param({"prefix_aware_routing": "maybe"}, "true or false", id="routing"),
        pytest.param(
            {"no_prefix_caching": True}, "prefix_aware_routing needs prefix caching", id="cache"
        ),
        pytest.param({"block_size": {"a": 1}}, "not a mapping", id="mapping"),
    ],
)
def test_a_bad_argument_fails_naming_it(args: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_app_args(args)
