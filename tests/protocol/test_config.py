"""The core's and workers' logging and self-checks come in their configs, not in the
environment: the log level given to LLM reaches both processes, a bad one is refused
before any starts, and PAGEDSERVE_CHECK_INVARIANTS=1 is read by the launcher and handed
to the core, which then checks. The configs hold no second copy of EngineArgs' defaults:
a setting a launcher leaves out stops the process, naming it. The socket addresses the
core and workers derive from one address, and the parent and memory probes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest

from launch import LLM, AsyncLLM, SamplingParams
from launch.client.engine_args import EngineArgs, core_config, worker_config
from protocol.config import (
    EngineCoreConfig,
    WorkerConfig,
    any_port,
    available_host_memory,
    ipc_address,
    parent_alive,
    worker_sockets,
)
from protocol.envs import CHECK_INVARIANTS as CHECK_INVARIANTS_ENV
from tests.helpers.cli_helpers import CPU, children_of

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# INFO lines each process writes once at start-up.
CORE_INFO = "pagedserve.core: engine core: waiting for 1 worker(s)"
WORKER_INFO = "pagedserve.worker: worker rank 0: loading"
CHECKS_ON = "pagedserve.core: engine core: checking the KV invariants after every step"


def _core_config(llm: LLM) -> EngineCoreConfig:
    """The config the running core was started with (sent on its stdin)."""
    config = llm.engine.configs["engine core"]
    assert isinstance(config, EngineCoreConfig)
    return config


@pytest.mark.parametrize(("level", "logged"), [("info", True), ("WARNING", False)])
def test_the_log_level_given_to_llm_is_the_core_and_worker_level(
    level: str, logged: bool, llama_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The children write to the stderr they inherited: capfd reads the file descriptor.
    with LLM(str(llama_dir), log_level=level, device=CPU) as llm:
        assert _core_config(llm).log_level == level.upper()
    err = capfd.readouterr().err
    assert (CORE_INFO in err, WORKER_INFO in err) == (logged, logged), err


@pytest.mark.parametrize("engine", [LLM, AsyncLLM], ids=["LLM", "AsyncLLM"])
def test_a_bad_log_level_is_refused_before_any_process_starts(
    engine: type[LLM] | type[AsyncLLM],
    llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the socket folder goes
    before = set(children_of(os.getpid()))
    with pytest.raises(ValueError) as info:
        engine(str(llama_dir), log_level="loud", device=CPU)
    assert str(info.value) == (
        "log_level (any case) must be DEBUG or INFO or WARNING or ERROR or CRITICAL, not 'LOUD'"
    )
    assert set(children_of(os.getpid())) <= before, "a process was started"
    assert not list(tmp_path.glob("pagedserve-*")), "an engine's socket folder was made"


@pytest.mark.parametrize(("env", "checked"), [("1", True), (None, False)], ids=["set", "unset"])
def test_pagedserve_check_invariants_reaches_the_core_in_its_config(
    env: str | None,
    checked: bool,
    llama_dir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if env is None:
        monkeypatch.delenv(CHECK_INVARIANTS_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECK_INVARIANTS_ENV, env)
    with LLM(str(llama_dir), log_level="INFO", device=CPU) as llm:
        assert _core_config(llm).check_invariants is checked
        # With the checks on, every step and the idle pool after the last one are walked.
        outs = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length", "length"]
    err = capfd.readouterr().err
    assert (CHECKS_ON in err) is checked, err
    assert "Traceback" not in err, err


# The fields a config may leave out, by the rule in protocol/config.py: None where it
# means "none for this launch", and the only copy of a setting EngineArgs lacks. Any
# other default would be a second copy of EngineArgs'.
NONE_FOR_THIS_LAUNCH = {
    EngineCoreConfig: {
        "parent_pid",
        "private_dir",
        "kv_events_endpoint",
        "kv_events_replay_endpoint",
        "record_dir",
        "record_worker",
        "spin_us",
        "zmq_curve_keys",
        "speculative_config",  # None: no speculation
    },
    WorkerConfig: {"dist_init", "parent_pid", "spin_us", "zmq_curve_keys", "cpus", "node"},
}
ONLY_COPY = {
    EngineCoreConfig: {"kv_events_buffer_steps", "kv_events_topic"},
    WorkerConfig: {"core_timeout_s"},
}
# Read from the environment where the launcher builds the config (protocol/envs.py).
FROM_ENVIRONMENT = {
    EngineCoreConfig: set(),
    WorkerConfig: {"attention", "native_kernels", "cpu_gemm", "step_hooks"},
}


@pytest.mark.parametrize("config", [EngineCoreConfig, WorkerConfig], ids=lambda c: c.__name__)
def test_only_fields_that_restate_no_setting_have_defaults(config: type[msgspec.Struct]) -> None:
    defaults = {f.name: f.default for f in msgspec.structs.fields(config) if not f.required}
    assert defaults.keys() == (
        NONE_FOR_THIS_LAUNCH[config] | ONLY_COPY[config] | FROM_ENVIRONMENT[config]
    )
    assert {name: defaults[name] for name in NONE_FOR_THIS_LAUNCH[config]} == dict.fromkeys(
        NONE_FOR_THIS_LAUNCH[config]
    )


@pytest.mark.parametrize(
    ("module", "left_out"),
    [("enginecore.core", "max_num_seqs"), ("worker.main", "max_num_batched_tokens")],
)
def test_a_config_without_a_setting_stops_the_process_naming_it(module: str, left_out: str) -> None:
    # As the launcher makes them, less one setting: as if it had forgotten to pass it.
    args = EngineArgs(model="unused", device=CPU)
    config = (
        core_config(
            args, input_address="", output_address="", worker_address="", log_level="WARNING"
        )
        if module == "enginecore.core"
        else worker_config(
            args, model="unused", rank=0, world_size=1, core_address="", log_level="WARNING"
        )
    )
    fields = msgspec.to_builtins(config)
    del fields[left_out]
    proc = subprocess.run(
        [sys.executable, "-m", module, msgspec.json.encode(fields).decode()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"bad configuration: Object missing required field `{left_out}`" in proc.stderr


def test_worker_sockets_derive_from_one_address() -> None:
    assert worker_sockets("tcp://10.0.0.1:7000", 2) == (
        "tcp://10.0.0.1:7000",
        ["tcp://10.0.0.1:7001", "tcp://10.0.0.1:7002"],
    )
    assert worker_sockets("tcp://[::1]:7000", 1) == ("tcp://[::1]:7000", ["tcp://[::1]:7001"])
    assert worker_sockets(ipc_address("/run/ps", "w"), 1) == (
        "ipc:///run/ps/w.results",
        ["ipc:///run/ps/w.rank0"],
    )


@pytest.mark.parametrize(
    ("address", "world_size", "message"),
    [
        ("tcp://host", 1, "is not tcp://HOST:PORT"),
        ("tcp://:7000", 1, "is not tcp://HOST:PORT"),
        ("tcp://host:65534", 1, "port out of range"),
        ("udp://host:1", 1, "must start with tcp:// or ipc://"),
        ("ipc:///x", 0, "world_size must be >= 1, got 0"),
    ],
)
def test_a_bad_worker_address_is_refused_naming_it(
    address: str, world_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        worker_sockets(address, world_size)


def test_only_a_tcp_port_0_asks_for_any_port() -> None:
    assert any_port("tcp://127.0.0.1:0") == "127.0.0.1"
    assert any_port("tcp://127.0.0.1:10") is None
    assert any_port("ipc:///tmp/x0") is None


def test_the_parent_is_alive_while_it_is_ours() -> None:
    assert parent_alive(None) and parent_alive(os.getppid())
    assert not parent_alive(os.getppid() + 1)


def test_available_host_memory_is_what_proc_meminfo_says() -> None:
    with open("/proc/meminfo") as f:
        line = next(x for x in f if x.startswith("MemAvailable:"))
    want = int(line.split()[1]) * 1024
    got = available_host_memory()
    # Memory moves between the two reads; within 10%.
    assert got is not None and abs(got - want) <= want // 10
