"""Serve's request router for the engine deployment: a request goes to the replica whose
engine holds the longest cached prefix of its prompt, read from the engines' own KV events
(protocol.kv_events.CachedPrefixView), unless that replica is busier than the least busy by
more than a bound; otherwise, and for requests with nothing to score, Serve's power of two
choices. It runs where the handle is (each ingress replica), inside Serve's routing loop."""

from __future__ import annotations

import logging

import msgspec
import zmq
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from launch.serve_app.app_args import DEFAULT_MAX_LOAD_IMBALANCE
from launch.serve_app.engine_replica import EVENTS_KEY, REPLAY_KEY
from launch.serve_app.forwarding import ForwardedRequest
from protocol.kv_events import END_OF_REPLAY, CachedPrefixView, KVEventBatch
from protocol.zmq_security import ClientKeys, load_client_keys, secure_client

log = logging.getLogger("pagedserve.serve_app")


class ReplicaEvents:
    """One replica's KV events, applied in sequence order without blocking: the SUB
    socket's batches, and the replay socket's answer whenever a gap (or joining late)
    leaves something out."""

    def __init__(self, ctx: zmq.Context, events: str, replay: str, keys: ClientKeys | None):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure_client(self.sub, keys, events)
        self.sub.connect(events)
        self.replay = ctx.socket(zmq.DEALER)
        secure_client(self.replay, keys, replay)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.view = CachedPrefixView()
        self.next_seq = 0
        self.replaying = False
        self._ask_replay()  # what the engine stored before this subscription

    def _ask_replay(self) -> None:
        self.replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        self.replaying = True

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq == self.next_seq:  # else a duplicate (both sockets sent it)
            self.next_seq += 1
            self.view.apply(self.decoder.decode(payload))

    def sync(self) -> None:
        while self.replay.poll(0):
            _empty, _topic, seq, payload = self.replay.recv_multipart()
            if seq == END_OF_REPLAY:
                self.replaying = False
            else:
                self._apply(int.from_bytes(seq, "big"), payload)
        while self.sub.poll(0):
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq and not self.replaying:
                self._ask_replay()  # a gap: the replay fills it, in order
            self._apply(seq, payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


class PrefixAwareRouter(PowerOfTwoChoicesRequestRouter):
    """request_router_kwargs: max_load_imbalance (ongoing requests over the least busy
    replica's that a prefix hit may cost), zmq_curve_keys (the keys directory when the
    engines' sockets speak CURVE)."""

    def initialize_state(
        self,
        max_load_imbalance: int = DEFAULT_MAX_LOAD_IMBALANCE,
        zmq_curve_keys: str | None = None,
    ) -> None:
        self.max_load_imbalance = max_load_imbalance
        self._keys = None if zmq_curve_keys is None else load_client_keys(zmq_curve_keys)
        self._ctx = zmq.Context.instance()
        self._events: dict[ReplicaID, ReplicaEvents] = {}
        # Decisions, for logs and tests: prefix hits routed, hits skipped for load, others.
        self.decisions = {"prefix_hit": 0, "load_skip": 0, "no_hit": 0}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # A replaced or scaled-down replica's events are of no further use.
        live = {r.replica_id for r in replicas}
        for replica_id in [r for r in self._events if r not in live]:
            self._events.pop(replica_id).close()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        events = self._events.pop(replica_id, None)
        if events is not None:
            events.close()

    def _replica_events(self, replica: RunningReplica) -> ReplicaEvents | None:
        events = self._events.get(replica.replica_id)
        if events is None:
            stats = replica.routing_stats or {}
            if not stats.get(EVENTS_KEY) or not stats.get(REPLAY_KEY):
                return None  # its first stats have not arrived yet
            events = ReplicaEvents(self._ctx, stats[EVENTS_KEY], stats[REPLAY_KEY], self._keys)
            self._events[replica.replica_id] = events
        events.sync()
        return events

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        preferred = self._prefix_choice(candidate_replicas, pending_request)
        if not preferred or pending_request is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Serve tries the ranks in order: when every holder of the prefix is full, any
        # other replica; when all are, it waits (backs off) before asking again.
        pending_request.routing_context.should_backoff = True
        others = [r for r in candidate_replicas if r not in preferred]
        return [preferred, others] if others else [preferred]

    def _prefix_choice(
        self, candidates: list[RunningReplica], pending: PendingRequest | None
    ) -> list[RunningReplica]:
        request = pending.args[0] if pending is not None and pending.args else None
        if not isinstance(request, ForwardedRequest) or not request.block_hashes:
            return []
        hashes = request.block_hashes
        scores: list[int] = []
        for replica in candidates:
            events = self._replica_events(replica)
            scores.append(0 if events is None else events.view.cached_prefix_blocks(hashes))
        best = max(scores, default=0)
        if best == 0:
            self.decisions["no_hit"] += 1
            return []
        cache = self._replica_queue_len_cache
        load = [cache.get(r.replica_id) or 0 for r in candidates]
        least = min(load)
        chosen = [
            r
            for r, score, busy in zip(candidates, scores, load)
            if score == best and busy - least <= self.max_load_imbalance
        ]
        self.decisions["prefix_hit" if chosen else "load_skip"] += 1
        log.debug("prefix router: %d cached blocks; %s", best, self.decisions)
        return chosen
