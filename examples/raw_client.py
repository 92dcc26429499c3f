#!/usr/bin/env python3
"""Drive an EngineCore with nothing but pyzmq and msgspec, as docs/protocol.md describes.

    python examples/raw_client.py [--model DIR] [--zmq-curve-keys DIR]

Binds the client's two sockets (ipc, or with keys loopback TCP spoken over CURVE), starts
the core and one worker as `python -m MODULE -` processes with their configs as JSON on
stdin (never in argv: a config may hold the hash seed), waits for EngineReady, adds three
requests (one reusing an open id, which is rejected), aborts one, follows the others to
their finish, and shuts the engine down. Prints what it sees; the last stdout line is a
JSON summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.client.engine_args import DEFAULT_LOG_LEVEL, EngineArgs, core_config, worker_config
from protocol.config import EngineCoreConfig, WorkerConfig, ipc_address
from protocol.engine import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    CoreMessage,
    EngineDead,
    EngineOutputs,
    EngineReady,
    SamplingParams,
    ShutdownCore,
)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    p.add_argument(
        "--zmq-curve-keys",
        metavar="DIR",
        help="a `pagedserve keys` directory: the client's sockets bind loopback TCP, and "
        "the core admits this client by its key",
    )
    a = p.parse_args(argv)
    if a.model is None:
        from launch.client.builtin_model import builtin_model_dir

        a.model = str(builtin_model_dir())

    sockets_dir = tempfile.mkdtemp(prefix="raw-client-")
    ctx = zmq.Context()
    to_core = ctx.socket(zmq.PUSH)  # the client binds both of its sockets
    from_core = ctx.socket(zmq.PULL)
    core, worker = configs(a.model, sockets_dir)
    if a.zmq_curve_keys is not None:
        core = bind_curve(to_core, from_core, core, a.zmq_curve_keys)
    else:
        to_core.bind(core.input_address)
        from_core.bind(core.output_address)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(CoreMessage).decode
    procs = [start(mod, cfg) for mod, cfg in (("enginecore.core", core), ("worker.main", worker))]
    summary: dict = {"tokens": {}, "finish": {}, "rejected": []}
    try:
        if not from_core.poll(300_000):
            raise SystemExit("the engine did not start")
        ready = decode(from_core.recv())
        assert isinstance(ready, EngineReady), ready
        print(f"ready: {ready.num_gpu_blocks} blocks of {ready.block_size} tokens")

        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        long = SamplingParams(max_tokens=2000, ignore_eos=True)
        send: list[ClientMessage] = [
            AddRequest("a", [1, 2, 3, 4], params),
            AddRequest("b", [5, 6, 7], long),
            AddRequest("a", [9], params),  # "a" is open: rejected, "a" goes on
        ]
        for msg in send:
            to_core.send(encode(msg))
        to_core.send(encode(AbortRequests(["b"])))
        follow(from_core, decode, summary, num_requests=2)
        to_core.send(encode(ShutdownCore()))
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        ctx.destroy(linger=0)
    print(json.dumps(summary))
    return 0


def start(module: str, config: EngineCoreConfig | WorkerConfig) -> subprocess.Popen:
    """`python -m module -`, its config written to its stdin and closed."""
    proc = subprocess.Popen([sys.executable, "-m", module, "-"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(config))
    proc.stdin.close()
    return proc


def bind_curve(
    to_core: zmq.Socket, from_core: zmq.Socket, core: EngineCoreConfig, keys: str
) -> EngineCoreConfig:
    """Bind both client sockets on free loopback ports as CURVE clients of the core (the
    core is the CURVE server whichever side binds); the core's config with those ports."""
    public, secret = zmq.auth.load_certificate(Path(keys, "client.key_secret"))
    server_public = zmq.auth.load_certificate(Path(keys, "server.key"))[0]
    for sock in (to_core, from_core):
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    inp = to_core.bind_to_random_port("tcp://127.0.0.1")
    out = from_core.bind_to_random_port("tcp://127.0.0.1")
    return msgspec.structs.replace(
        core,
        input_address=f"tcp://127.0.0.1:{inp}",
        output_address=f"tcp://127.0.0.1:{out}",
        zmq_curve_keys=keys,
    )


def configs(model: str, sockets_dir: str) -> tuple[EngineCoreConfig, WorkerConfig]:
    """The core's and the worker's configs. They have no defaults of their own to fall
    back on: EngineArgs holds them, and the launcher's helpers make both configs from it."""
    args = EngineArgs(model=model, device="cpu")
    core = core_config(
        args,
        input_address=ipc_address(sockets_dir, "input"),
        output_address=ipc_address(sockets_dir, "output"),
        worker_address=ipc_address(sockets_dir, "workers"),
        log_level=DEFAULT_LOG_LEVEL,
    )
    worker = worker_config(
        args,
        model=model,
        rank=0,
        world_size=1,
        core_address=core.worker_address,
        log_level=DEFAULT_LOG_LEVEL,
    )
    return core, worker


def follow(
    from_core: zmq.Socket, decode: Callable[[bytes], Any], summary: dict, num_requests: int
) -> None:
    """Read the core's outputs into summary until num_requests have finished."""
    deadline = time.monotonic() + 300
    while len(summary["finish"]) < num_requests and time.monotonic() < deadline:
        if not from_core.poll(1000):
            continue
        msg = decode(from_core.recv())
        if isinstance(msg, EngineDead):
            raise SystemExit(f"engine died: {msg.reason}")
        assert isinstance(msg, EngineOutputs)
        for r in msg.rejected:
            print(f"rejected {r.request_id}: {r.reason}")
            summary["rejected"].append(r.request_id)
        for o in msg.outputs:
            summary["tokens"].setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                summary["finish"][o.request_id] = o.finish_reason
                print(f"{o.request_id}: {o.finish_reason} after {summary['tokens'][o.request_id]}")


if __name__ == "__main__":
    raise SystemExit(main())
