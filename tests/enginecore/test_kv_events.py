"""KV-cache events as a router sees them: every change published, in vLLM's layout, with
sequence numbers, a replay socket for lost messages, and bounded memory."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from enginecore import KVCacheManager, Request
from enginecore.kv_event_publisher import DEFAULT_HWM, KVEventPublisher
from launch import LLM, SamplingParams
from protocol.block_hash import BlockHasher
from protocol.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedPrefixView,
    KVEventBatch,
)
from tests.helpers.cli_helpers import CPU
from tests.helpers.hf_checkpoints import save_checkpoint
from tests.helpers.kv_helpers import (
    admit,
    check_stored_hashes,
    decode,
    full,
    make_manager,
    tokens,
    window,
)

# -- a subscriber written against vLLM's published event layout, not our structs -------


class VStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class VCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """Applies every batch in sequence order to a per-group set of cached hashes; on a gap
    it asks the replay socket for what it missed."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None,
        pump: Callable[[], None] = lambda: None,
    ) -> None:
        # pump: lets an in-process publisher answer while we wait for a replay.
        self.pump = pump
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.ctx = ctx
        self.decoder = msgspec.msgpack.Decoder(VBatch)
        self.cached: dict[int, set[bytes]] = {}
        # The same batches through our own decoder, into a router's view.
        self.view = CachedPrefixView()
        self.view_decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.next_seq = 0
        self.stored: list[VStored] = []
        self.num_removed = 0
        self.replays = 0

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"batch {seq} applied out of order"
        self.next_seq += 1
        self.view.apply(self.view_decoder.decode(payload))
        for event in self.decoder.decode(payload).events:
            if isinstance(event, VStored):
                self.cached.setdefault(event.group_idx or 0, set()).update(event.block_hashes)
                self.stored.append(event)
            elif isinstance(event, VRemoved):
                group = self.cached.setdefault(event.group_idx or 0, set())
                for h in event.block_hashes:
                    assert h in group, "removed a hash that was never stored"
                    group.remove(h)
                self.num_removed += len(event.block_hashes)
            else:
                self.cached.clear()

    def poll(self, timeout_ms: int, drop: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Receive what has arrived; batches whose seq is in drop are discarded as if
        lost on the way. Returns the batches received."""
        n = 0
        while self.sub.poll(timeout_ms):
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            n += 1
            timeout_ms = 0
            if seq in drop:
                continue
            if seq > self.next_seq:
                self.catch_up()
            if seq == self.next_seq:
                self.apply(seq, payload)
        return n

    def sync(self, last_seq: int, drop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Receive until every batch up to last_seq is applied; a quiet spell asks the
        replay socket (a lost batch is noticed only when a later one comes). Waits as long
        as the machine needs: a loaded one may deliver seconds late, and the publisher's
        bounded buffer must not move past a gap before it is asked."""
        deadline = time.monotonic() + 120  # only so that a broken publisher cannot hang CI
        while self.next_seq <= last_seq:
            assert time.monotonic() < deadline, f"stuck at batch {self.next_seq}"
            if not self.poll(200, drop):
                self.catch_up()

    def catch_up(self) -> None:
        assert self.replay_endpoint is not None, "a gap, and no replay socket"
        self.replays += 1
        # DEALER, not REQ: the answer is many messages, and REQ takes only one.
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        deadline = time.monotonic() + 60  # only so that a broken publisher cannot hang CI
        while True:
            self.pump()
            if not req.poll(20):
                assert time.monotonic() < deadline, "the replay socket did not answer"
                continue
            frames = req.recv_multipart()
            if frames[-2] == END_OF_REPLAY:
                break
            _empty, _topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if seq == self.next_seq:
                self.apply(seq, payload)
        req.close(linger=0)


def core_view(manager: KVCacheManager) -> dict[int, set[bytes]]:
    pool = manager.block_pool
    cached = {g: {h for h, _ in pool.cached_entries(g)} for g in range(pool.num_groups)}
    return {g: hashes for g, hashes in cached.items() if hashes}


def churn(manager: KVCacheManager, publisher: KVEventPublisher, steps: int, seed: int) -> None:
    """Requests sharing prefixes arrive, run and finish in a pool far too small for them
    all: blocks are cached, hit, evicted; one batch of events per step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(4, 24))] for _ in range(6)]
    live: list[Request] = []
    for step in range(steps):
        if live and (rng.random() < 0.5 or len(live) > 3):
            manager.free(live.pop(rng.randrange(len(live))))
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
        r = Request(f"s{step}", prompt, manager.block_hasher)
        hits, num_hit = manager.get_computed_blocks(r)
        new = manager.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits if num_hit else None)
        if new is not None:
            r.num_computed_tokens = r.num_tokens
            live.append(r)
        if step % 97 == 0:
            for x in live:
                manager.free(x)
            live.clear()
            assert manager.reset_prefix_cache()
        publisher.publish(manager.take_events())
        publisher.serve_replays()
    for x in live:
        manager.free(x)


@pytest.mark.parametrize(
    "specs",
    [(full(),), (full(), window(6)), (full(8), window(12, 4))],
    # The last: full blocks of 8 tokens span two 4-token hash blocks each.
    ids=["full", "hybrid", "two-block-sizes"],
)
def test_subscriber_rebuilds_the_cached_hashes(specs: tuple) -> None:
    ctx = zmq.Context()
    manager = make_manager(24, *specs, enable_kv_events=True, hash_seed=b"s3cret")
    publisher = KVEventPublisher(ctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 64)
    sub = Subscriber(ctx, publisher.endpoint, publisher.replay_endpoint, publisher.serve_replays)
    try:
        # PUB drops messages for a subscriber that has not finished joining: publish
        # until one arrives, then start from a clean slate.
        while not sub.poll(20):
            publisher.publish(manager.take_events() or [_cleared()])
        sub.next_seq, sub.cached = publisher.next_seq, {}
        assert manager.reset_prefix_cache()
        publisher.publish(manager.take_events())
        sub.sync(publisher.next_seq - 1)
        drop = {sub.next_seq + 5, sub.next_seq + 6, sub.next_seq + 40}
        for chunk in range(6):
            # 50 batches a chunk, fewer than the replay buffer's 64: a gap is still
            # buffered when the subscriber notices it.
            churn(manager, publisher, 50, seed=chunk)
            sub.sync(publisher.next_seq - 1, drop)
        assert sub.next_seq == publisher.next_seq
        assert sub.replays >= 1
        assert manager.block_pool.num_evictions > 100
        assert {g: h for g, h in sub.cached.items() if h} == core_view(manager)
        assert len(specs) == 1 or 1 in sub.cached  # the window group published too
        for event in sub.stored:
            check_stored_hashes(event, manager.block_hasher)  # type: ignore[arg-type]
        # Each stored event says what its group's cache is, as vLLM's do.
        kinds = {
            (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in sub.stored
        }
        windows = [getattr(spec, "sliding_window", None) for spec in specs]
        expected = {
            (i, "sliding_window" if w else "full_attention", w) for i, w in enumerate(windows)
        }
        assert kinds == expected
    finally:
        publisher.close()
        sub.sub.close(linger=0)
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    "specs",
    [(full(),), (full(), window(6)), (window(5), full(), window(13))],
    ids=["full", "hybrid", "two-windows"],
)
def test_a_view_of_the_events_predicts_every_prefix_hit(specs: tuple) -> None:
    """A router's score from the published events alone (decoded from the wire) equals
    the hit the engine's own lookup finds, prompt after prompt, while requests decode,
    windows drop old blocks and a small pool evicts."""
    m = make_manager(40, *specs, enable_kv_events=True, hash_seed=b"view")
    view = CachedPrefixView()
    to_wire, from_wire = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(KVEventBatch)
    rng = random.Random(11)
    prefixes = [[rng.randrange(60) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    live: list[Request] = []
    hits_seen = set()
    for step in range(400):
        if live and (rng.random() < 0.4 or len(live) > 4):
            m.free(live.pop(rng.randrange(len(live))))
        for r in live:
            decode(m, r, rng.randrange(60))
        view.apply(from_wire.decode(to_wire(KVEventBatch(0.0, m.take_events()))))
        prompt = rng.choice(prefixes) + [rng.randrange(60) for _ in range(rng.randint(0, 9))]
        r = Request(f"p{step}", prompt, m.block_hasher)
        # The engine recomputes a prompt's last token: at most len - 1 tokens hit.
        predicted = view.cached_prefix_blocks(r.block_hashes[: (len(prompt) - 1) // 4]) * 4
        assert m.get_computed_blocks(r)[1] == predicted, f"step {step}"
        hits_seen.add(predicted > 0)
        if admit(m, r) is not None:
            live.append(r)
    assert hits_seen == {True, False}
    assert m.block_pool.num_evictions > 50


def test_a_view_asks_every_window_again_until_they_agree() -> None:
    """Windows of 1 and 3 blocks over a fully cached full-attention group: at 6 blocks the
    first window holds block 4 (a hit of 5), the second then needs blocks 1-3 (4); at 4
    the first lacks block 3 (3), and at 3 the second lacks block 0: nothing hits."""
    h = [bytes([i]) * 16 for i in range(6)]

    def stored(group: int, held: list[int], kind: str, window: int | None) -> BlockStored:
        return BlockStored(
            block_hashes=[h[i] for i in held],
            parent_block_hash=None,  # the view needs only hashes and groups
            token_ids=[0] * 4 * len(held),
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )

    view = CachedPrefixView()
    view.apply(
        KVEventBatch(
            0.0,
            [
                stored(0, [0, 1, 2, 3, 4, 5], "full_attention", None),
                stored(1, [2, 4], "sliding_window", 5),  # reads 1 block back
                stored(2, [1, 2, 3], "sliding_window", 13),  # reads 3 blocks back
            ],
        )
    )
    assert view.window_blocks == {1: 1, 2: 3}
    assert view.cached_prefix_blocks(h) == 0
    view.apply(KVEventBatch(0.0, [stored(2, [0], "sliding_window", 13)]))
    assert view.cached_prefix_blocks(h) == 3  # blocks 0-2 in every group
    view.apply(KVEventBatch(0.0, [AllBlocksCleared()]))
    assert view.cached_prefix_blocks(h) == 0


def _cleared():
    from protocol.kv_events import AllBlocksCleared

    return AllBlocksCleared()


def test_content_evicted_and_stored_again_in_one_step_is_removed_first() -> None:
    """A hash evicted and then cached again within one step is announced removed before
    it is stored: a subscriber applying the batch in order ends with the core's cached
    hashes."""
    m = make_manager(9, enable_kv_events=True)
    a = Request("a", [*tokens("ABCDEFGH"), 1], m.block_hasher)
    admit(m, a)
    m.free(a)  # two cached blocks, tail first in line for eviction
    cached: set[bytes] = set(m.take_events()[0].block_hashes)  # type: ignore[union-attr]
    # One step: d's allocation evicts a's second block; c (a's prompt again, no prefix
    # lookup) caches that content anew.
    d = Request("d", list(range(500, 527)), m.block_hasher)
    assert m.allocate_slots(d, d.num_tokens) is not None
    m.free(d)
    c = Request("c", [*tokens("ABCDEFGH"), 2], m.block_hasher)
    assert m.allocate_slots(c, c.num_tokens) is not None
    events = m.take_events()
    evicted = a.block_hashes[1]
    order = [
        type(e).__name__
        for e in events
        if isinstance(e, BlockStored | BlockRemoved) and evicted in e.block_hashes
    ]
    assert order == ["BlockRemoved", "BlockStored"]
    for e in events:
        if isinstance(e, BlockStored):
            cached.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached.difference_update(e.block_hashes)
    assert cached == {h for h, _ in m.block_pool.cached_entries(0)}


def test_a_step_announces_its_evictions_once_after_its_stores() -> None:
    """Two allocations in one step each evict cached blocks and store new ones: one
    BlockRemoved names every eviction, after the stores (no hash in it was stored again),
    and applying the step in order gives the core's cached hashes."""
    m = make_manager(9, enable_kv_events=True)
    cached: set[bytes] = set()
    for name, prompt in (("a", [*tokens("ABCDEFGH"), 1]), ("b", [*tokens("IJKLMNOP"), 2])):
        r = Request(name, prompt, m.block_hasher)
        admit(m, r)
        m.free(r)
        cached.update(r.block_hashes)
    m.take_events()
    # One step: c takes six of the eight free blocks (two of them cached), d the last two.
    c = Request("c", list(range(100, 121)), m.block_hasher)
    d = Request("d", list(range(200, 206)), m.block_hasher)
    assert m.allocate_slots(c, c.num_tokens) is not None
    assert m.allocate_slots(d, d.num_tokens) is not None
    events = m.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert set(events[2].block_hashes) == cached  # type: ignore[union-attr]
    for e in events:
        if isinstance(e, BlockStored):
            cached.update(e.block_hashes)
        else:
            cached.difference_update(e.block_hashes)  # type: ignore[union-attr]
    assert cached == {h for h, _ in m.block_pool.cached_entries(0)}


def test_a_batch_on_the_wire_is_vllm_s_array_of_tagged_maps() -> None:
    """The bytes a subscriber gets, read without any schema: [ts, events, rank], each event
    a map tagged by "type" with vLLM's fields."""
    ctx = zmq.Context()
    m = make_manager(9, enable_kv_events=True)
    publisher = KVEventPublisher(ctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 4, topic="kv")
    dealer = ctx.socket(zmq.DEALER)
    try:
        r = Request("r", [*tokens("ABCDEFGH"), 1], m.block_hasher)
        admit(m, r)
        publisher.publish(m.take_events())
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while not dealer.poll(20):
            publisher.serve_replays()
        _empty, topic, seq, payload = dealer.recv_multipart()
        assert (topic, seq) == (b"kv", (0).to_bytes(8, "big"))
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank is None
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": r.block_hashes,
                "parent_block_hash": None,
                "token_ids": tokens("ABCDEFGH"),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]
    finally:
        dealer.close(linger=0)
        publisher.close()
        ctx.destroy(linger=0)


def test_a_salted_block_is_published_with_its_salt_s_digest_never_the_salt() -> None:
    """Subscribers (and the replay buffer) get a fixed-size keyed digest: a tenant's salt
    neither leaks to them nor makes a batch as large as the salt."""
    m = make_manager(9, enable_kv_events=True, hash_seed=b"deployment")
    salt = "tenant-secret" * 100_000
    r = Request("r", [*tokens("ABCDEFGH"), 1], m.block_hasher, cache_salt=salt)
    admit(m, r)
    (event,) = m.take_events()
    assert isinstance(event, BlockStored)
    assert event.extra_keys == [(("salt", m.block_hasher.salt_digest(salt)),), None]
    check_stored_hashes(event, m.block_hasher)  # recomputable from the event alone
    payload = msgspec.msgpack.encode(KVEventBatch(0.0, [event]))
    assert len(payload) < 400 and b"tenant-secret" not in payload


def test_without_a_replay_socket_no_batch_is_kept() -> None:
    """Nobody can ask for a replay, so nothing is buffered for one."""
    ctx = zmq.Context()
    manager = make_manager(16, enable_kv_events=True)
    publisher = KVEventPublisher(ctx, "tcp://127.0.0.1:0", None, buffer_steps=16)
    try:
        churn(manager, publisher, 100, seed=4)
        assert publisher.next_seq > 50
        assert not publisher._buffer
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_memory_stays_bounded_without_subscribers() -> None:
    ctx = zmq.Context()
    manager = make_manager(16, enable_kv_events=True)
    publisher = KVEventPublisher(ctx, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=16)
    try:
        churn(manager, publisher, 300, seed=3)
        assert publisher.next_seq > 100
        assert len(publisher._buffer) == 16
        # What the socket may queue is bounded too (PUB drops past it, it never blocks).
        assert publisher.pub.getsockopt(zmq.SNDHWM) == DEFAULT_HWM
        assert not manager.block_pool._events  # drained each step
        req = ctx.socket(zmq.DEALER)
        req.connect(publisher.replay_endpoint)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            publisher.serve_replays()
            if not req.poll(50):
                continue
            frames = req.recv_multipart()
            if frames[-2] == END_OF_REPLAY:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        assert seqs == list(range(publisher.next_seq - 16, publisher.next_seq))
        req.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("checkpoint", ["llama", "qwen2_interleaved"], ids=["full", "hybrid"])
def test_events_from_a_running_engine_predict_its_prefix_hits(
    checkpoint: str, llama_dir: Path, tmp_path: Path
) -> None:
    """A router's use: compute a prompt's block hashes with the deployment's seed, score
    them against the published events (CachedPrefixView), and expect exactly that many
    cached tokens; with sliding-window layers too, whose window group keeps only the
    blocks its window reads."""
    groups = 1
    model_dir = llama_dir
    if checkpoint != "llama":
        groups = 2  # sliding-window layers and full layers: two block tables per request
        model_dir = tmp_path / checkpoint
        save_checkpoint(checkpoint, model_dir)
    seed = "router-shared-secret"
    rng = random.Random(5)
    # Four 40-token prefixes in rotation through a pool that holds about two: by the
    # time a prefix comes back, part or all of it was evicted (LRU, tail first).
    prefixes = [[rng.randrange(3, 160) for _ in range(40)] for _ in range(4)]
    order = [0, 1, 2, 0, 3, 1, 2, 3, 0, 1, 1]
    prompts = [
        prefixes[i] + [rng.randrange(3, 160) for _ in range(rng.randint(3, 20))] for i in order
    ]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ctx = zmq.Context()
    with LLM(
        str(model_dir),
        device=CPU,
        block_size=4,
        # About two prompts' worth: prefixes are evicted between uses. (A window group
        # frees a request's old blocks early, and they go first: a little more room.)
        num_gpu_blocks=32 if groups == 1 else 80,
        max_model_len=80,
        prefix_cache_hash_seed=seed,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
    ) as llm:
        ready = llm.engine.ready
        assert ready.kv_events_endpoint and ready.kv_events_replay_endpoint
        sub = Subscriber(ctx, ready.kv_events_endpoint, ready.kv_events_replay_endpoint)
        hasher = BlockHasher(4, "xxh3_128", seed.encode())
        checked = 0
        for i, prompt in enumerate(prompts):
            # The core publishes a step's events before its outputs, so once generate
            # returns, a replay from our next sequence number holds all of them (what
            # the SUB socket already delivered is applied first, in order).
            sub.poll(0)
            sub.catch_up()
            hashes: list[bytes] = []
            hasher.extend(hashes, prompt)
            # The last prompt token always runs: at most len - 1 tokens can hit.
            predicted = 4 * sub.view.cached_prefix_blocks(hashes[: (len(prompt) - 1) // 4])
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            assert out.num_cached_tokens == predicted, f"prompt {i}"
            checked += predicted > 0
        assert checked >= 3 and sub.num_removed > 0, (checked, sub.num_removed)
        for event in sub.stored:
            check_stored_hashes(event, hasher)  # type: ignore[arg-type]
        assert len(sub.view.window_blocks) == groups - 1
    sub.sub.close(linger=0)
    ctx.destroy(linger=0)
