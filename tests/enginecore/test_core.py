"""enginecore/core.py's pure helpers (the process itself runs in the launch tests): the
scheduler's settings come from the launcher's config, the block-hash seed is the user's or
fresh per start, and an AddRequest that does not decode still fails its own request."""

from __future__ import annotations

import msgspec
import pytest

from enginecore.core import SCHEDULER_SETTINGS, _answer_malformed, hash_seed, scheduler_config
from launch.client.engine_args import EngineArgs, core_config
from protocol.codec import Codec, ProtocolError
from protocol.engine import ClientMessage


def _config(**settings: object) -> object:
    return core_config(
        EngineArgs(model="unused", **settings),  # type: ignore[arg-type]
        input_address="",
        output_address="",
        worker_address="",
        log_level="WARNING",
    )


def test_the_scheduler_takes_the_launcher_s_settings_and_the_core_s_limits() -> None:
    config = _config(max_num_seqs=3, scheduling_policy="priority", enable_prefix_caching=False)
    sched = scheduler_config(config, max_model_len=77, hash_seed=b"k")
    assert (sched.max_num_seqs, sched.scheduling_policy) == (3, "priority")
    assert sched.enable_prefix_caching is False
    assert (sched.max_model_len, sched.hash_seed) == (77, b"k")
    for name in SCHEDULER_SETTINGS:
        if name not in ("max_num_batched_tokens", "prefill_tokens_per_request"):
            assert getattr(sched, name) == getattr(config, name)


def test_the_step_budget_is_the_user_s_or_the_device_s_default() -> None:
    unset = _config()
    assert scheduler_config(unset, device="cpu", max_model_len=8).max_num_batched_tokens == 512
    assert scheduler_config(unset, device="cuda:0", max_model_len=8).max_num_batched_tokens == 8192
    for device in ("cpu", "cuda"):
        chosen = scheduler_config(
            _config(max_num_batched_tokens=96), device=device, max_model_len=8
        )
        assert chosen.max_num_batched_tokens == 96


def test_the_prefill_beside_decodes_is_the_user_s_or_the_device_s_default() -> None:
    unset = _config()
    assert scheduler_config(unset, device="cpu", max_model_len=8).prefill_tokens_per_request == 8
    assert scheduler_config(unset, device="cuda", max_model_len=8).prefill_tokens_per_request == 0
    for device in ("cpu", "cuda"):
        for chosen in (0, 24):
            config = _config(prefill_tokens_per_request=chosen)
            sched = scheduler_config(config, device=device, max_model_len=8)
            assert sched.prefill_tokens_per_request == chosen


def test_the_hash_seed_is_the_user_s_or_fresh_at_each_start() -> None:
    assert hash_seed(_config(prefix_cache_hash_seed="shared")) == b"shared"
    unseeded = _config()
    first, second = hash_seed(unseeded), hash_seed(unseeded)
    assert len(first) == 16 and first != second


def _decode_error(frame: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        Codec(ClientMessage, "client->core").decode(frame)
    return caught.value


def test_an_add_request_that_does_not_decode_fails_its_own_request() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "add", "request_id": "r7", "prompt_token_ids": "not a list"}
    )
    error = _decode_error(frame)
    [output] = _answer_malformed(memoryview(frame), error)
    assert output.request_id == "r7" and output.finish_reason == "error"
    assert output.new_token_ids == [] and output.error == f"request r7: {error}"


@pytest.mark.parametrize(
    "frame",
    [
        msgspec.msgpack.encode({"type": "abort", "request_ids": 5}),  # not an add
        msgspec.msgpack.encode({"type": "add", "request_id": 9}),  # no id to name
        b"\xc1",  # not msgpack at all
    ],
)
def test_a_frame_without_a_request_to_name_is_answered_with_nothing(frame: bytes) -> None:
    assert _answer_malformed(memoryview(frame), _decode_error(frame)) == []
