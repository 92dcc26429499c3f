"""Secrets and sockets of a running engine: the hash seed reaches the core (its events'
block hashes chain from it) but no process's command line; with a keys directory the KV
events and their replay go only to key holders, a stranger gets nothing and the engine
serves on; a seed typed on the command line is refused, naming where it belongs."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from launch import LLM, SamplingParams
from launch.cli_flags import build_parser, engine_kwargs
from protocol import envs
from protocol.block_hash import BlockHasher
from protocol.kv_events import END_OF_REPLAY, CachedPrefixView, KVEventBatch
from protocol.zmq_security import load_client_keys, make_keys, secure_client
from tests.helpers.cli_helpers import CPU

BLOCK = 4
PROMPT = list(range(40, 53))  # three full blocks and one token
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _subscriber(ctx: zmq.Context, endpoint: str, keys_dir: Path | None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if keys_dir is not None:
        secure_client(sub, load_client_keys(str(keys_dir)), endpoint)
    sub.connect(endpoint)
    return sub


def _replay(ctx: zmq.Context, endpoint: str, keys_dir: Path | None) -> list[list[bytes]]:
    """Every buffered batch the replay socket sends back; none if it never answers."""
    dealer = ctx.socket(zmq.DEALER)
    if keys_dir is not None:
        secure_client(dealer, load_client_keys(str(keys_dir)), endpoint)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    got = []
    while dealer.poll(10_000 if keys_dir is not None else 1_000):
        frames = dealer.recv_multipart()
        if frames[2] == END_OF_REPLAY:
            break
        got.append(frames)
    return got


def test_the_seed_and_events_reach_key_holders_only_and_no_command_line(
    llama_dir: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    make_keys(keys, ["client"])
    seed = "seed-" + secrets.token_hex(8)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # a failed assertion must not leave a context that hangs
    try:
        _check_seed_and_events(llama_dir, keys, seed, ctx)
    finally:
        ctx.destroy(linger=0)


def _check_seed_and_events(llama_dir: Path, keys: Path, seed: str, ctx: zmq.Context) -> None:
    with LLM(
        str(llama_dir),
        device=CPU,
        block_size=BLOCK,
        prefix_cache_hash_seed=seed,
        zmq_curve_keys=str(keys),
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
    ) as llm:
        ready = llm.engine.ready
        assert ready.kv_events_endpoint and ready.kv_events_replay_endpoint
        # The core holds the seed, sent on its stdin: no process shows it to `ps`.
        assert llm.engine.configs["engine core"].prefix_cache_hash_seed == seed  # type: ignore[attr-defined]
        for name, proc in llm.engine.procs.items():
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            assert seed.encode() not in cmdline, name
            assert b"prefix_cache_hash_seed" not in cmdline, name
        stranger = _subscriber(ctx, ready.kv_events_endpoint, None)
        friend = _subscriber(ctx, ready.kv_events_endpoint, keys)
        # Wait until the key holder is admitted: PUB drops what no subscriber takes.
        joined = friend.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        assert joined.poll(30_000), "the key holder was not admitted"
        (first,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
        # The handshake can finish before the publisher has taken the subscription in, and
        # PUB drops what it sends meanwhile: then the batch comes from the replay socket,
        # which also admits key holders only.
        batches = [friend.recv_multipart()] if friend.poll(5_000) else []
        batches = batches or _replay(ctx, ready.kv_events_replay_endpoint, keys)
        assert batches, "no KV event reached the key holder"
        view = CachedPrefixView()
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        for batch in batches:
            view.apply(decode(batch[-1]))
        # The events' hashes chain from the seed: a router holding it finds the prompt.
        for key, found in ((seed, len(PROMPT) // BLOCK), ("another seed", 0)):
            hashes: list[bytes] = []
            BlockHasher(BLOCK, "xxh3_128", key.encode()).extend(hashes, PROMPT)
            assert view.cached_prefix_blocks(hashes) == found, key
        assert len(_replay(ctx, ready.kv_events_replay_endpoint, keys)) >= 1
        # The stranger got nothing, its replay request no answer; the engine serves on.
        assert not stranger.poll(500)
        assert _replay(ctx, ready.kv_events_replay_endpoint, None) == []
        (again,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
        assert again.token_ids == first.token_ids and len(first.token_ids) == 6
        assert again.num_cached_tokens == (len(PROMPT) // BLOCK) * BLOCK


def test_a_seed_on_the_command_line_is_refused_naming_both_alternatives() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "serve", "--prefix-cache-hash-seed", "s3cret"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "--prefix-cache-hash-seed-file PATH" in proc.stderr, proc.stderr
    assert envs.PREFIX_CACHE_HASH_SEED in proc.stderr


def _seed(argv: list[str]) -> str | None:
    return engine_kwargs(
        build_parser().parse_args(["generate", "--input", "i", "--output", "o", *argv])
    )["prefix_cache_hash_seed"]


def test_the_seed_comes_from_its_file_else_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(envs.PREFIX_CACHE_HASH_SEED, raising=False)
    assert _seed([]) is None
    monkeypatch.setenv(envs.PREFIX_CACHE_HASH_SEED, "from-env")
    assert _seed([]) == "from-env"
    path = tmp_path / "seed"
    path.write_text("from-file\n")
    assert _seed(["--prefix-cache-hash-seed-file", str(path)]) == "from-file"
    path.write_text("")
    with pytest.raises(SystemExit):
        _seed(["--prefix-cache-hash-seed-file", str(path)])


def test_a_keys_directory_that_cannot_serve_fails_before_any_process_starts(
    tmp_path: Path,
) -> None:
    from launch.client.engine_args import EngineArgs

    with pytest.raises(ValueError, match=r"zmq_curve_keys: .*server\.key_secret not found"):
        EngineArgs(model="m", zmq_curve_keys=str(tmp_path)).validate()
    make_keys(tmp_path / "k", ["client"])
    (tmp_path / "k" / "client.key_secret").unlink()
    # Spawned workers over TCP load the client keypair too.
    args = EngineArgs(model="m", zmq_curve_keys=str(tmp_path / "k"))
    args.validate()
    tcp = EngineArgs(
        model="m", zmq_curve_keys=str(tmp_path / "k"), worker_address="tcp://127.0.0.1:29550"
    )
    with pytest.raises(ValueError, match=r"client\.key_secret not found"):
        tcp.validate()
