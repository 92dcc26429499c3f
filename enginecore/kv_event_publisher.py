"""Publishes the core's KV-cache events on ZeroMQ, as vLLM's publisher does.

PUB socket: one message per step that changed the cache, three frames (topic, sequence
number as 8 bytes big-endian, msgpack KVEventBatch). PUB never blocks the core: a slow or
absent subscriber loses messages at the high-water mark, and notices by the gap in the
sequence numbers. ROUTER socket (optional): a subscriber sends the first sequence number
it lacks (8 bytes big-endian) after an empty delimiter frame, from a DEALER socket (a
REQ socket would read only the first of the answers), and gets back every batch still
buffered from there, each as (empty, topic, seq, payload), then (empty, empty, -1,
empty). Memory is bounded: the last `buffer_steps` batches, whether anyone listens or
not (none without a replay socket).

Everything runs on the core's thread, between steps: encoding a step's events and one
non-blocking send. The core polls the replay socket with its other sockets, so replays
are answered while idle too.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from protocol.kv_events import END_OF_REPLAY, KVCacheEvent, KVEventBatch
from protocol.zmq_security import ServerKeys, secure_server

log = logging.getLogger("pagedserve.core")

DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
_MORE = zmq.SNDMORE | zmq.NOBLOCK


def should_bind(endpoint: str) -> bool:
    """vLLM's rule, plus port 0: wildcard hosts, ipc and inproc bind; a port-0 address binds
    a free port (reported back); any other address is a subscriber to connect to."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.endswith(":0")
    )


class KVEventPublisher:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        topic: str = "",
        data_parallel_rank: int | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"kv events buffer_steps must be >= 1, got {buffer_steps}")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
        self.pub.setsockopt(zmq.LINGER, 0)
        # Events carry tenants' token ids: only subscribers with an allowed key get them.
        secure_server(self.pub, keys, endpoint)
        self.endpoint = _open(self.pub, endpoint)
        self.replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            secure_server(self.replay, keys, replay_endpoint)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._send = self.pub.send
        log.info(
            "KV events: publishing on %s%s",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One batch, if there is anything to say."""
        if not events:
            return
        seq = self._next_seq
        self._next_seq = seq + 1
        payload = self._encode(KVEventBatch(time.time(), events, self._rank))
        if self.replay is not None:  # without a replay socket nobody can ask for it
            self._buffer.append((seq, payload))
        # PUB drops at the high-water mark instead of blocking, so no frame can fail after
        # the first was queued; NOBLOCK is only a guard. Three sends, not send_multipart,
        # which costs more per message.
        send = self._send
        try:
            send(self._topic, _MORE)
            send(seq.to_bytes(8, "big"), _MORE)
            send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass

    def serve_replays(self) -> None:
        """Answer every replay request waiting on the ROUTER socket."""
        replay = self.replay
        if replay is None:
            return
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning(
                    "KV events: ignoring a malformed replay request (%d frames)", len(frames)
                )
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            sent = 0
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
                    sent += 1
            replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
            log.debug("KV events: replayed %d batches from %d", sent, start)

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def _open(sock: zmq.Socket, endpoint: str) -> str:
    if should_bind(endpoint):
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint
