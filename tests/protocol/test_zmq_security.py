"""CURVE on the engine's TCP sockets (protocol/zmq_security.py): `pagedserve keys` makes a
private keys directory; a server socket admits only the directory's client keys, so a
stranger gets nothing; a stranger's refused handshake does not read as a lost peer."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from protocol.zmq_security import (
    KeysError,
    PeerWatch,
    leaves_host,
    load_client_keys,
    load_server_keys,
    make_keys,
    secure_client,
    secure_server,
    start_authenticator,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_pagedserve_keys_makes_a_private_directory_of_private_secrets(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    cmd = [sys.executable, "-m", "launch.cli", "keys", str(keys), "--client", "w", "--client", "r"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert _mode(keys) == 0o700
    names = {p.name for p in keys.iterdir()}
    assert names == {f"{n}.{ext}" for n in ("server", "w", "r") for ext in ("key", "key_secret")}
    for name in names:
        assert _mode(keys / name) == (0o600 if name.endswith("_secret") else 0o644), name
    # Keys are never overwritten: a second run would strand every peer holding the first.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 1
    assert "already holds keys: make new ones in a new directory" in again.stderr


def test_a_secret_readable_by_other_users_or_missing_is_refused(tmp_path: Path) -> None:
    make_keys(tmp_path / "k", ["client"])
    secret = tmp_path / "k" / "server.key_secret"
    os.chmod(secret, 0o644)
    with pytest.raises(KeysError, match=re.escape(f"readable by other users: chmod 600 {secret}")):
        load_server_keys(str(tmp_path / "k"))
    (tmp_path / "k" / "client.key_secret").unlink()
    with pytest.raises(KeysError, match=r"client\.key_secret not found"):
        load_client_keys(str(tmp_path / "k"))


@pytest.mark.parametrize(
    ("address", "leaves"),
    [
        ("tcp://127.0.0.1:5557", False),
        ("tcp://localhost:5557", False),
        ("tcp://[::1]:5557", False),
        ("tcp://*:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://10.1.2.3:5557", True),
        ("ipc:///tmp/x", False),
    ],
)
def test_which_addresses_leave_the_host(address: str, leaves: bool) -> None:
    assert leaves_host(address) is leaves


def _wait(predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_stranger_gets_nothing_and_is_no_peer_while_a_key_holder_gets_all(
    tmp_path: Path,
) -> None:
    make_keys(tmp_path / "k", ["client"])
    server_keys = load_server_keys(str(tmp_path / "k"))
    client_keys = load_client_keys(str(tmp_path / "k"))
    ctx = zmq.Context()
    auth = start_authenticator(ctx, server_keys)
    try:
        push = ctx.socket(zmq.PUSH)
        push.sndtimeo = 10_000
        secure_server(push, server_keys, "tcp://127.0.0.1:0")
        address = f"tcp://127.0.0.1:{push.bind_to_random_port('tcp://127.0.0.1')}"
        watch = PeerWatch(push)
        plain = ctx.socket(zmq.PULL)  # no CURVE at all
        plain.connect(address)
        unknown = ctx.socket(zmq.PULL)  # CURVE, the right server, a key not admitted
        unknown.curve_serverkey = client_keys.server_public
        unknown.curve_publickey, unknown.curve_secretkey = zmq.curve_keypair()
        unknown.connect(address)
        # Both strangers were refused at least once before the key holder comes.
        refused = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        denied = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        assert refused.poll(10_000) and denied.poll(10_000)
        good = ctx.socket(zmq.PULL)
        good.rcvtimeo = 10_000  # a stolen step fails the test, not hangs it
        secure_client(good, client_keys, address)
        good.connect(address)
        for i in range(6):
            push.send(b"step %d" % i)  # blocks until a peer is admitted
        assert [good.recv() for _ in range(6)] == [b"step %d" % i for i in range(6)]
        assert not plain.poll(300) and not unknown.poll(300)
        assert not watch.check(), "a refused stranger read as a lost peer"
        good.close(linger=0)
        assert _wait(watch.check), "the admitted peer's departure went unnoticed"
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_a_config_comes_on_stdin_and_a_bad_one_is_named() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "enginecore.core", "-"],
        input=b'{"input_address": 3}',
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert b"enginecore: bad configuration: Expected `str`" in proc.stderr, proc.stderr


def test_a_socket_beyond_loopback_without_keys_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = zmq.Context()
    try:
        for address in ("tcp://127.0.0.1:5557", "ipc:///tmp/x", "tcp://0.0.0.0:5557"):
            secure_server(ctx.socket(zmq.PUB), None, address)
    finally:
        ctx.destroy(linger=0)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, warned
    assert (
        "tcp://0.0.0.0:5557 is reachable from other machines without authentication" in (warned[0])
    )
    assert "--zmq-curve-keys DIR" in warned[0]
