"""Workers started on their own (`pagedserve worker`), as on other machines: separate
process trees that find the core over TCP on loopback (or an ipc path).

No test picks a free port: the core binds port 0 itself and logs the address it got,
which the test reads before starting workers; ranks meet through a rendezvous file."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from protocol.config import worker_sockets
from protocol.zmq_security import make_keys
from tests.helpers.cli_helpers import CPU, ENV, StderrWatch, generate_cli, generate_cmd

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11, 12], [30, 31]]
LINES = [json.dumps({"prompt_token_ids": p, "temperature": 0, "max_tokens": 8}) for p in PROMPTS]
# With prompt logprobs too: every rank takes the prompt positions' logits (the LM head
# gathers across ranks), rank 0 answers.
TP_LINES = [
    *LINES,
    json.dumps(
        {"prompt_token_ids": PROMPTS[1], "temperature": 0, "max_tokens": 2, "prompt_logprobs": 2}
    ),
]


class Cluster:
    """A core address, a rendezvous file, and worker process trees of their own.

    tcp=True: the core binds free ports (tcp://127.0.0.1:0) and workers start once it
    logged them. tcp=False: an ipc path, so workers may start before the core."""

    def __init__(self, tp: int, tmp: Path, tcp: bool = False) -> None:
        self.tp = tp
        self.core = "tcp://127.0.0.1:0" if tcp else f"ipc://{tmp / 'core'}"
        self.dist = f"file://{tmp / 'dist-store'}"
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

    def start_core(self, inp: Path, out: Path, *flags: str) -> tuple[subprocess.Popen, StderrWatch]:
        """`pagedserve generate` waiting for external workers; with tcp, learns the port."""
        gen = subprocess.Popen(
            generate_cmd(inp, out, *self.flags(), *flags),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        watch = StderrWatch(gen)
        if self.core.endswith(":0"):
            self.core = watch.wait_for(r"workers connect to --core (tcp://\S+)").group(1)
        return gen, watch

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


def _write_lines(tmp: Path, lines: list[str]) -> tuple[Path, Path]:
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    inp.write_text("".join(x + "\n" for x in lines))
    return inp, out


def _strangers(ctx: zmq.Context, core: str, tp: int) -> list[zmq.Socket]:
    """Sockets without keys on every port of the core: a PULL on each rank's steps (to
    steal them) and a PUSH on the results (to forge answers)."""
    results, steps = worker_sockets(core, tp)
    socks = []
    for kind, address in [(zmq.PULL, a) for a in steps] + [(zmq.PUSH, results)]:
        sock = ctx.socket(kind)
        sock.linger = 0
        sock.connect(address)
        socks.append(sock)
    with contextlib.suppress(zmq.Again):  # queued until admitted: never, with keys
        socks[-1].send(b"forged", zmq.NOBLOCK)
    return socks


def test_external_workers_with_keys_give_the_spawned_outputs_and_strangers_nothing(
    llama_dir: Path, tmp_path: Path
) -> None:
    spawned_dir, external_dir = tmp_path / "spawned", tmp_path / "external"
    spawned_dir.mkdir()
    external_dir.mkdir()
    proc, spawned = generate_cli(llama_dir, TP_LINES, spawned_dir, "--tp", "2", "--block-size", "4")
    assert proc.returncode == 0, proc.stderr
    _check_prompt_logprobs(llama_dir, spawned[-1])
    keys = ("--zmq-curve-keys", str(tmp_path / "keys"))
    make_keys(tmp_path / "keys", ["client"])
    cluster = Cluster(2, tmp_path, tcp=True)
    ctx = zmq.Context()
    try:
        inp, out = _write_lines(external_dir, TP_LINES)
        gen, watch = cluster.start_core(
            inp, out, "--model", str(llama_dir), "--block-size", "4", *keys
        )
        # Strangers connect first: without CURVE they would take rank 0's acceptance
        # and steps, and their departure would read as a lost rank.
        strangers = _strangers(ctx, cluster.core, 2)
        for rank in (1, 0):  # any order: the core waits for both
            cluster.start(rank, llama_dir, "--block-size", "4", *keys)
        assert gen.wait(timeout=600) == 0, watch.join()
        assert not any(s.poll(0) for s in strangers[:-1]), "a stranger got a step"
        external = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(external) == len(spawned) == len(TP_LINES)
        assert [r["token_ids"] for r in external] == [r["token_ids"] for r in spawned]
        assert all(len(r["token_ids"]) == 8 for r in external[: len(LINES)])
        assert external[-1]["prompt_logprobs"] == spawned[-1]["prompt_logprobs"]
        # The core's shutdown reaches the external workers: they exit by themselves.
        for worker in cluster.workers.values():
            assert worker.wait(timeout=60) == 0
    finally:
        cluster.stop()
        ctx.destroy(linger=0)


def _check_prompt_logprobs(model: Path, result: dict) -> None:
    """A TP 2 run's prompt logprobs: a log-softmax of transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = result["prompt_token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    entries = result["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for i, entry in enumerate(entries[1:], start=1):
        assert abs(entry["logprob"] - float(want[i - 1, prompt[i]])) < 1e-4, i
        assert entry["top_token_ids"] == want[i - 1].topk(2).indices.tolist(), i


def test_a_worker_that_never_arrives_is_named(llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(2, tmp_path)
    try:
        # Started first, over ipc: its hello waits for the core, so it is surely counted
        # as connected when the short start-up timeout below runs out.
        cluster.start(1, llama_dir)  # rank 0 never comes
        proc, _ = generate_cli(llama_dir, LINES, tmp_path, *cluster.flags(timeout=6))
        assert proc.returncode == 1
        assert "worker rank(s) [0] never connected" in proc.stderr, proc.stderr
        assert "rank 1 (pid" in proc.stderr
    finally:
        cluster.stop()


def test_mismatched_kv_specs_stop_start_up(llama_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(2, tmp_path)
    try:
        cluster.start(0, llama_dir)
        cluster.start(1, llama_dir, "--dtype", "float16")
        proc, _ = generate_cli(llama_dir, LINES, tmp_path, *cluster.flags())
        assert proc.returncode == 1
        assert "worker rank 1 reports KV cache specs that differ from rank 0" in proc.stderr
        assert "dtype float32 vs float16" in proc.stderr, proc.stderr
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("worker_flags", "message"),
    [
        (("--block-size", "8"), "--block-size 8 (the core: --block-size 16)"),
        (("--tp", "2", "--dist-init", "file:///nonexistent"), "--tp 2 (the core: --tp 1)"),
    ],
)
def test_a_worker_started_with_other_settings_is_refused_at_once(
    worker_flags: tuple[str, ...], message: str, llama_dir: Path, tmp_path: Path
) -> None:
    cluster = Cluster(1, tmp_path)
    try:
        worker = cluster.start(0, llama_dir, *worker_flags)
        proc, _ = generate_cli(llama_dir, LINES, tmp_path, *cluster.flags())
        assert proc.returncode == 1
        assert message in proc.stderr, proc.stderr
        assert "start the core and every worker with the same settings" in proc.stderr
        # The worker hears it too, and exits instead of loading or waiting for a group.
        assert worker.wait(timeout=120) == 1
        assert message in worker.stderr.read()
    finally:
        cluster.stop()


def test_a_worker_without_a_core_gives_up_with_a_message(tmp_path: Path) -> None:
    cluster = Cluster(1, tmp_path)
    worker = cluster.start(0, None, "--core-timeout", "2")
    try:
        assert worker.wait(timeout=120) == 1
        err = worker.stderr.read()
        assert "no engine core answered at ipc://" in err and "--core-timeout" in err, err
    finally:
        cluster.stop()


def test_a_taken_worker_address_is_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # held open: nobody else can have this port
        taken.listen()
        port = taken.getsockname()[1]
        flags = ("--external-workers", "--worker-address", f"tcp://127.0.0.1:{port}")
        proc, _ = generate_cli(llama_dir, LINES, tmp_path, *flags)
    assert proc.returncode == 1
    assert f"cannot listen for workers at tcp://127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_killing_a_rank_fails_requests_and_stops_the_rest(tmp_path: Path) -> None:
    cluster = Cluster(2, tmp_path, tcp=True)
    try:
        lines = [json.dumps({"prompt": "abc", "max_tokens": 3000, "ignore_eos": True})] * 3
        inp, out = _write_lines(tmp_path, lines)
        gen, watch = cluster.start_core(inp, out, "--log-level", "INFO")
        for rank in (0, 1):
            cluster.start(rank, None)  # the built-in model: long generations fit
        # Logged once every rank has its KV cache, just before the requests go in: from
        # here on the run needs both ranks for minutes of steps.
        watch.wait_for(r"KV cache: \d+ blocks")
        assert gen.poll() is None, "generation ended before the kill"
        cluster.workers[1].send_signal(signal.SIGKILL)
        assert gen.wait(timeout=300) == 1
        stderr = watch.join()
        assert "worker rank 1" in stderr, stderr
        results = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(results) == len(lines)
        for r in results:
            assert r["finish_reason"] == "error" and "worker rank 1" in r["error"], r
        # Rank 0 loses its peer mid-collective or hears the core go: it exits, not hangs.
        cluster.workers[0].wait(timeout=120)
    finally:
        cluster.stop()
