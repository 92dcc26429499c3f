"""KV-aware routing over data-parallel replicas: each replica's prefix cache as its KV
events describe it, and the choice of replica for a prompt.

ReplicaEvents follows one replica's event stream on the event loop: a task applies each
batch as it arrives (work per step that changed the cache, nothing per token), and fills
a gap in the sequence numbers from the replica's replay socket, so a lost message costs a
stale view for a moment, never a wrong one for good. PrefixRouter hashes a prompt as the
engines do (protocol/block_hash.py, the deployment's shared seed) and picks the replica
that holds its longest cached prefix; ties go to the least loaded, and a replica far
above the mean load is skipped whatever it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from protocol.block_hash import BlockHasher, ExtraKeys
from protocol.config import HashAlgo
from protocol.kv_events import END_OF_REPLAY, CachedPrefixView, KVEventBatch
from protocol.zmq_security import ClientKeys, secure_client

log = logging.getLogger("pagedserve.router")

# A replica is skipped when its open requests exceed max(LOAD_FACTOR x mean, mean +
# LOAD_SLACK), the mean over the other replicas (with two, the mean over both could never
# be exceeded twice over): a hot prefix must not pile every request onto one replica.
LOAD_FACTOR = 2.0
LOAD_SLACK = 8
# How long a replay may take before the view is left as it is (the replica may be dying;
# its supervisor notices that).
REPLAY_TIMEOUT_MS = 5000
REASONS = ("prefix_hit", "tie", "load")


class ReplicaEvents:
    """One replica's cached prefixes, kept current from its KV events."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str,
        keys: ClientKeys | None = None,
    ) -> None:
        self.view = CachedPrefixView()
        self.next_seq = 0
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        secure_client(self.sub, keys, endpoint)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        secure_client(self.replay, keys, replay_endpoint)
        self.replay.connect(replay_endpoint)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Follow the stream from now on (on the running loop). Events published before
        the subscription took hold come from the replay socket at the first gap."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="kv-events")

    async def _follow(self) -> None:
        try:
            # Whatever was published before the SUB connected (a restarted replica's
            # first steps) is fetched once up front.
            await self._replay()
            while True:
                _topic, seq, payload = await self.sub.recv_multipart()
                n = int.from_bytes(seq, "big")
                if n == self.next_seq:
                    self._apply(payload)
                elif n > self.next_seq:
                    await self._replay()  # a gap: fetch it in order (this batch included)
        except asyncio.CancelledError:
            raise
        except Exception:  # a broken stream leaves the view as it was: routing still works
            log.exception("KV events: stopped following a replica")

    def _apply(self, payload: bytes) -> None:
        self.next_seq += 1
        self.view.apply(self._decode(payload))

    async def _replay(self) -> None:
        """Ask for every buffered batch from next_seq and apply them in order."""
        while await self.replay.poll(0):  # the tail of an answer that came too late
            await self.replay.recv_multipart()
        await self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            if not await self.replay.poll(REPLAY_TIMEOUT_MS):
                log.warning("KV events: a replica's replay socket did not answer")
                return
            _empty, _topic, seq, payload = await self.replay.recv_multipart()
            if seq == END_OF_REPLAY:
                return
            n = int.from_bytes(seq, "big")
            if n >= self.next_seq:  # past next_seq: the buffer no longer holds the gap
                self.next_seq = n
                self._apply(payload)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sub.close(linger=0)
        self.replay.close(linger=0)


class PrefixRouter:
    """Picks a replica per prompt; counts its decisions by reason (REASONS) and the
    decisions where the replica with the longest prefix was skipped for its load."""

    def __init__(
        self, block_size: int, hash_algo: HashAlgo, seed: bytes, caching: bool = True
    ) -> None:
        self.hasher = BlockHasher(block_size, hash_algo, seed)
        self.caching = caching
        self.decisions = dict.fromkeys(REASONS, 0)
        self.load_skips = 0
        self._turn = 0  # rotates among equally loaded replicas

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The prompt's block hashes as a replica computes them (a salt keys the first
        block; the chain carries it on)."""
        hashes: list[bytes] = []
        if not self.caching:
            return hashes
        extra: Callable[[int, int], ExtraKeys] | None = None
        if cache_salt is not None:
            salt = ("salt", self.hasher.salt_digest(cache_salt))
            extra = lambda start, _end: (salt,) if start == 0 else None  # noqa: E731
        self.hasher.extend(hashes, token_ids, extra)
        return hashes

    def choose(
        self,
        hashes: list[bytes],
        views: Sequence[CachedPrefixView | None],
        loads: Sequence[int],
    ) -> tuple[int, str, int]:
        """(replica, reason, cached blocks) for a prompt's hashes. views: one per replica,
        None for a replica not serving (never chosen); loads: each one's open requests.
        ValueError when no replica serves."""
        live = [i for i, v in enumerate(views) if v is not None]
        if not live:
            raise ValueError("no replica is serving")
        total = sum(loads[i] for i in live)
        others = max(len(live) - 1, 1)
        scores = {i: views[i].cached_prefix_blocks(hashes) if hashes else 0 for i in live}  # type: ignore[union-attr]
        eligible = [i for i in live if not _overloaded(loads[i], (total - loads[i]) / others)]
        eligible = eligible or live
        best = max(scores[i] for i in eligible)
        if max(scores.values()) > best:
            self.load_skips += 1  # the longest prefix sits on a replica too loaded to take it
        tied = [i for i in eligible if scores[i] == best]
        if best > 0 and len(tied) == 1:
            reason = "prefix_hit"
        else:
            reason = "tie" if best > 0 else "load"
            least = min(loads[i] for i in tied)
            tied = [i for i in tied if loads[i] == least]
        self._turn += 1
        choice = tied[self._turn % len(tied)]
        self.decisions[reason] += 1
        return choice, reason, best


def _overloaded(load: int, mean_of_others: float) -> bool:
    return load > max(LOAD_FACTOR * mean_of_others, mean_of_others + LOAD_SLACK)
