"""ZeroMQ CURVE security for the engine's TCP sockets (docs/security.md).

The EngineCore is always the CURVE server, whichever side binds: it holds the server
keypair and admits only the client public keys of its keys directory, checked by a ZAP
authenticator thread at each handshake. Workers, routers and raw clients are CURVE
clients: they hold a client keypair and the server's public key. ipc:// sockets carry no
CURVE: their 0700 folder already keeps other users out.

A keys directory (`pagedserve keys DIR`):

    server.key          the server's public key (every client needs it)
    server.key_secret   the server's keypair (the core only)
    NAME.key            a client's public key (the core admits every one present)
    NAME.key_secret     a client's keypair ("client" is the one clients load)
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("pagedserve.security")

SERVER = "server"
CLIENT = "client"
ZAP_DOMAIN = "pagedserve"
KEYS_FLAG = "--zmq-curve-keys"


class KeysError(ValueError):
    """A keys directory that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed: frozenset[bytes]  # the client public keys admitted


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def leaves_host(address: str) -> bool:
    """Whether a tcp:// address may be reached from other machines (anything but a
    loopback host)."""
    if not is_tcp(address):
        return False
    host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a wildcard, an interface or a host name


def make_keys(directory: str | Path, clients: list[str]) -> list[Path]:
    """A new keys directory (mode 0700) with the server keypair and one keypair per client
    name, secret files mode 0600; the files written. Refuses a directory that holds keys."""
    d = Path(directory)
    if (d / f"{SERVER}.key_secret").exists():
        raise KeysError(f"{d} already holds keys: make new ones in a new directory")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # an existing empty directory may have had looser bits
    written = []
    for name in (SERVER, *clients):
        public, secret = zmq.auth.create_certificates(d, name)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise KeysError(f"{path} not found (pagedserve keys DIR makes a keys directory)")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(f"{path} is readable by other users: chmod 600 {path}")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise KeysError(f"{path} holds no secret key")
    return public, secret


def _load_public(path: Path) -> bytes:
    if not path.is_file():
        raise KeysError(f"{path} not found (pagedserve keys DIR makes a keys directory)")
    return zmq.auth.load_certificate(path)[0]


def load_server_keys(directory: str) -> ServerKeys:
    """The core's keys: its keypair, and the client public keys it admits."""
    d = Path(directory)
    public, secret = _load_secret(d / f"{SERVER}.key_secret")
    allowed = [_load_public(p) for p in sorted(d.glob("*.key")) if p.name != f"{SERVER}.key"]
    if not allowed:
        raise KeysError(f"{d} holds no client public key (NAME.key): no peer could connect")
    return ServerKeys(public, secret, frozenset(allowed))


def load_client_keys(directory: str) -> ClientKeys:
    """A peer's keys: the client keypair and the server's public key."""
    d = Path(directory)
    public, secret = _load_secret(d / f"{CLIENT}.key_secret")
    return ClientKeys(public, secret, _load_public(d / f"{SERVER}.key"))


def secure_server(sock: zmq.Socket, keys: ServerKeys | None, address: str) -> None:
    """Make sock a CURVE server before it binds or connects to a tcp:// address; without
    keys, warn when the address leaves the host."""
    if not is_tcp(address):
        return
    if keys is None:
        if leaves_host(address):
            log.warning(
                "%s is reachable from other machines without authentication: anyone who "
                "connects can read and send engine traffic (%s DIR; docs/security.md)",
                address,
                KEYS_FLAG,
            )
        return
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.zap_domain = ZAP_DOMAIN.encode()


def secure_client(sock: zmq.Socket, keys: ClientKeys | None, address: str) -> None:
    """Make sock a CURVE client of the core before it binds or connects to address."""
    if keys is None or not is_tcp(address):
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """The ZAP handler that admits only keys.allowed at each CURVE handshake on ctx's
    server sockets; a refused peer never becomes a peer of the socket."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagedserve.security.zap"))
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(keys.allowed))
    return auth


class _AllowList:
    """The ZAP handler's question, answered from the keys read at start."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class PeerWatch:
    """Tells when a peer that completed its handshake disconnects. A connection that
    fails the handshake (a peer without an allowed key, a port scan) also ends with a
    disconnect; counting it would let any stranger take a rank down. ZeroMQ reports a
    failed handshake just before that connection's disconnect, without naming the
    connection, so each failure cancels the next disconnect."""

    __slots__ = ("_refused", "lost", "monitor")

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        self._refused = 0  # failed handshakes whose disconnect is still to come
        self.lost = False

    def check(self) -> bool:
        """Read the waiting events; True once a handshaken peer disconnected."""
        monitor = self.monitor
        while not self.lost and monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event != zmq.EVENT_DISCONNECTED:
                self._refused += 1
            elif self._refused:
                self._refused -= 1
            else:
                self.lost = True
        return self.lost


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
