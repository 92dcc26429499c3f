"""Workers started on their own (`pagedserve worker`), as on other machines: separate
process trees that find the core over TCP on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cli_helpers import CPU, ENV, generate_cli, generate_cmd

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11, 12], [30, 31]]
LINES = [json.dumps({"prompt_token_ids": p, "temperature": 0, "max_tokens": 8}) for p in PROMPTS]


def free_ports(n: int) -> int:
    """A base port with base .. base + n - 1 all free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class Cluster:
    """A core address, a rendezvous address, and worker process trees of their own."""

    def __init__(self, tp: int) -> None:
        base = free_ports(tp + 3)
        self.tp = tp
        self.core = f"tcp://127.0.0.1:{base}"
        self.dist = f"tcp://127.0.0.1:{base + tp + 2}"
        self.workers: dict[int, subprocess.Popen] = {}

    def flags(self, timeout: float = 120) -> tuple[str, ...]:
        return (
            "--external-workers",
            "--tp",
            str(self.tp),
            "--worker-address",
            self.core,
            "--dist-init",
            self.dist,
            "--worker-timeout",
            str(timeout),
        )

    def start(self, rank: int, model: Path | None, *extra: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "launch.cli",
            "worker",
            "--core",
            self.core,
            "--rank",
            str(rank),
            "--tp",
            str(self.tp),
            "--dist-init",
            self.dist,
            "--device",
            CPU,
            *extra,
        ]
        if model is not None:
            cmd += ["--model", str(model)]
        proc = subprocess.Popen(
            cmd,
            env=ENV,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.workers[rank] = proc
        return proc

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_external_workers_give_the_spawned_outputs(llama_dir: Path, tmp_path: Path) -> None:
    spawned_dir, external_dir = tmp_path / "spawned", tmp_path / "external"
    spawned_dir.mkdir()
    external_dir.mkdir()
    proc, spawned = generate_cli(llama_dir, LINES, spawned_dir, "--tp", "2", "--block-size", "4")
    assert proc.returncode == 0, proc.stderr
    cluster = Cluster(tp=2)
    try:
        for rank in (1, 0):  # any order: the core waits for both
            cluster.start(rank, llama_dir, "--block-size", "4")
        proc, external = generate_cli(llama_dir, LINES, external_dir, *cluster.flags())
        assert proc.returncode == 0, proc.stderr
        assert [r["token_ids"] for r in external] == [r["token_ids"] for r in spawned]
        assert all(len(r["token_ids"]) == 8 for r in external)
        # The core's shutdown reaches the external workers: they exit by themselves.
        for worker in cluster.workers.values():
            assert worker.wait(timeout=30) == 0
    finally:
        cluster.stop()


def test_a_worker_that_never_arrives_is_named(llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tp=2)
    try:
        cluster.start(1, llama_dir)  # rank 0 never comes
        start = time.monotonic()
        proc, _ = generate_cli(llama_dir, LINES, tmp_path, *cluster.flags(timeout=6))
        assert proc.returncode == 1
        assert time.monotonic() - start < 60
        assert "worker rank(s) [0] never connected" in proc.stderr, proc.stderr
        assert "rank 1 (pid" in proc.stderr
    finally:
        cluster.stop()


def test_mismatched_kv_specs_stop_start_up(llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tp=2)
    try:
        cluster.start(0, llama_dir, "--block-size", "4")
        cluster.start(1, llama_dir, "--block-size", "8")
        proc, _ = generate_cli(llama_dir, LINES, tmp_path, *cluster.flags())
        assert proc.returncode == 1
        assert "worker rank 1 reports KV cache specs that differ from rank 0" in proc.stderr
        assert "block_size 4 vs 8" in proc.stderr, proc.stderr
    finally:
        cluster.stop()


def test_killing_a_rank_fails_requests_and_stops_the_rest(tmp_path: Path) -> None:
    cluster = Cluster(tp=2)
    try:
        for rank in (0, 1):
            cluster.start(rank, None)  # the built-in model: long generations fit
        lines = [json.dumps({"prompt": "abc", "max_tokens": 3000, "ignore_eos": True})] * 3
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text("".join(x + "\n" for x in lines))
        gen = subprocess.Popen(
            generate_cmd(inp, out, *cluster.flags()),
            env=ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(8)  # start-up, then some steps
        assert gen.poll() is None, "generation ended before the kill"
        cluster.workers[1].send_signal(signal.SIGKILL)
        _, stderr = gen.communicate(timeout=120)
        assert gen.returncode == 1
        assert "worker rank 1" in stderr, stderr
        results = [json.loads(x) for x in out.read_text().splitlines()]
        assert all(r["finish_reason"] == "error" and "worker rank 1" in r["error"] for r in results)
        # Rank 0 loses its peer mid-collective or hears the core go: it exits, not hangs.
        cluster.workers[0].wait(timeout=60)
    finally:
        cluster.stop()
