"""The Ray executor on a real two-node Ray cluster (Ray's own multi-node test cluster, on
this machine): tensor-parallel ranks as actors in a placement group, the same tokens as
transformers and as plain processes, a lost rank named with its node, nothing left behind."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from launch.cli_flags import build_parser, engine_kwargs
from launch.client.engine_args import EngineArgs
from launch.client.engine_processes import EngineDeadError
from launch.client.llm import LLM, SamplingParams
from launch.client.ray_executor import RayPlacementError, RayRank
from tests.helpers.cli_helpers import (
    ENV,
    StderrWatch,
    all_gone,
    generate_cmd,
    processes_mentioning,
)
from tests.helpers.hf_checkpoints import hf_greedy, save_checkpoint
from tests.helpers.ray_cluster import ray_cluster

ROOT = Path(__file__).resolve().parents[3]
CPU = "cpu"
MAX_TOKENS = 10
PROMPTS = [
    [5, 17, 33, 41, 9, 120, 77],
    [5, 17, 33, 41, 9, 120, 77, 3, 58, 99, 14],
    [140, 22, 61],
    [88, 8, 151, 47, 66, 19, 30, 102, 11, 45, 73, 27, 90],
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two Ray nodes of one CPU each, told apart by a custom resource; this process is
    the driver."""
    with ray_cluster(2) as c:
        yield c


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(checkpoint, transformers' greedy continuations of PROMPTS)."""
    path = tmp_path_factory.mktemp("llama")
    hf_model = save_checkpoint("llama", path)
    return path, [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


def ray_llm(model: str | None, tp: int = 2, **kwargs: object) -> LLM:
    kwargs.setdefault("placement_strategy", "SPREAD")
    return LLM(
        model, device=CPU, tensor_parallel_size=tp, distributed_executor_backend="ray", **kwargs
    )


def node_resource(node_id: str) -> str:
    """The custom resource (node_a / node_b) of the cluster node with this id."""
    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    return next(r for r in node["Resources"] if r.startswith("node_") and ":" not in r)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def leftovers(pids: list[int]) -> list[str]:
    """What an engine left: live actors' processes, placement groups not removed, CPUs
    still held in the cluster."""
    left = [f"pid {p}" for p in pids if not all_gone([p], timeout=10)]
    left += [
        f"placement group {pg_id} {pg['state']}"
        for pg_id, pg in placement_group_table().items()
        if pg["state"] != "REMOVED"
    ]
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    if ray.available_resources().get("CPU", 0) < 2:
        left.append(f"resources held: {ray.available_resources()}")
    return left


def test_tp2_spread_over_two_nodes_equals_transformers_and_tp2_without_ray(
    cluster: Cluster, llama: tuple[Path, list[list[int]]]
) -> None:
    path, expected = llama
    llm = ray_llm(str(path), block_size=4)
    try:
        ranks = [llm.engine.procs[f"worker rank {r}"] for r in range(2)]
        assert all(isinstance(r, RayRank) for r in ranks)
        nodes = [node_resource(r.place.node_id) for r in ranks]  # type: ignore[union-attr]
        assert sorted(nodes) == ["node_a", "node_b"]  # SPREAD: a node per rank
        config = llm.engine.configs["worker rank 1"]
        assert config.core_address.startswith("tcp://")  # type: ignore[attr-defined]
        assert config.dist_init.startswith("tcp://")  # type: ignore[attr-defined]
        assert greedy(llm) == expected
    finally:
        llm.close()
    plain = LLM(str(path), device=CPU, tensor_parallel_size=2, block_size=4)
    try:
        assert greedy(plain) == expected
    finally:
        plain.close()


def test_ranks_all_on_the_launchers_node_take_the_private_sockets_spawned_workers_take(
    cluster: Cluster,
) -> None:
    held = placement_group([{"CPU": 1, "node_b": 1}])  # the other node is full
    ray.get(held.ready(), timeout=30)
    try:
        llm = ray_llm(None, tp=1, num_gpu_blocks=64)
        try:
            rank = llm.engine.procs["worker rank 0"]
            assert node_resource(rank.place.node_id) == "node_a"  # type: ignore[union-attr]
            config = llm.engine.configs["worker rank 0"]
            assert config.core_address.startswith("ipc://")  # type: ignore[attr-defined]
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
            assert len(out.token_ids) == 4
        finally:
            llm.close()
    finally:
        remove_placement_group(held)
    assert leftovers([]) == []


def test_startup_and_shutdown_leave_no_actor_placement_group_or_process(
    cluster: Cluster,
) -> None:
    llm = ray_llm(None, num_gpu_blocks=64)
    pids = [p.pid for p in llm.engine.procs.values()]
    assert len(pids) == 3  # the core (a process here) and two actors
    assert [pg["state"] for pg in placement_group_table().values()].count("CREATED") == 1
    assert ray.available_resources().get("CPU", 0) == 0  # both bundles held
    llm.close()
    assert leftovers(pids) == []
    assert ray.is_initialized()  # the driver's own connection stays


@pytest.mark.parametrize("loss", ["actor", "node"])
def test_a_lost_rank_fails_open_requests_within_seconds_naming_its_node_and_rank(
    cluster: Cluster, loss: str
) -> None:
    # The built-in model (4096 positions): four long requests still run when the loss lands.
    llm = ray_llm(None, num_gpu_blocks=1100)
    engine = llm.engine
    pids = [p.pid for p in engine.procs.values()]
    # The rank on the second node: the driver is connected through the head node.
    ((rank, victim),) = [
        (r, engine.procs[f"worker rank {r}"])
        for r in range(2)
        if node_resource(engine.procs[f"worker rank {r}"].place.node_id) == "node_b"  # type: ignore[union-attr]
    ]
    assert isinstance(victim, RayRank)
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for rid in tokens:
        engine.add_request(rid, [5, 6, 7], params)
    errors: dict[str, str | None] = {}
    lost_at = None
    with pytest.raises(EngineDeadError) as dead:
        while len(errors) < len(tokens):
            batch = engine.get_outputs()
            for o in batch.outputs if batch is not None else ():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.finish_reason == "error", o
                    errors[o.request_id] = o.error
            if lost_at is None and all(tokens.values()):
                lost_at = time.monotonic()  # mid-run: every request has streamed tokens
                if loss == "actor":
                    ray.kill(victim.actor)
                else:
                    (node,) = [n for n in cluster.worker_nodes if n.node_id == victim.place.node_id]
                    cluster.remove_node(node, allow_graceful=False)
        failed_in = time.monotonic() - lost_at
        engine.get_outputs(timeout_ms=10_000)  # then the engine reports its death
    assert failed_in < 10, f"open requests failed {failed_in:.1f} s after the {loss} was lost"
    where = victim.place.describe()
    for rid, error in errors.items():
        assert f"worker rank {rank} disconnected" in (error or ""), error
        assert where in (error or ""), error
        assert 0 < len(tokens[rid]) < 3000
    assert f"worker rank {rank}" in str(dead.value) and where in str(dead.value), dead.value
    llm.close()
    if loss == "node":  # the next tests want two nodes again
        cluster.add_node(num_cpus=1, resources={"node_b": 1})
        cluster.wait_for_nodes()
    assert leftovers(pids) == []


def test_a_cluster_too_small_for_the_bundles_fails_at_once_naming_what_is_missing(
    cluster: Cluster,
) -> None:
    start = time.monotonic()
    # A short wait: a cluster that could never hold them must not wait at all.
    with pytest.raises(RayPlacementError, match=r"3 bundle\(s\) of \{CPU: 1\}.*2 in all"):
        ray_llm(None, tp=3, startup_timeout_s=5)
    with pytest.raises(RayPlacementError, match=r"STRICT_PACK.*at most 1 on one node"):
        ray_llm(None, placement_strategy="STRICT_PACK", startup_timeout_s=5)
    assert time.monotonic() - start < 5
    assert leftovers([]) == []


def test_a_cluster_busy_past_the_start_up_timeout_fails_naming_what_is_free(
    cluster: Cluster,
) -> None:
    held = placement_group([{"CPU": 1}], strategy="PACK")  # another job's reservation
    ray.get(held.ready(), timeout=30)
    try:
        start = time.monotonic()
        free = r"\{CPU: 1\}.*within 2 s.*available now: CPU: 1\b"
        with pytest.raises(RayPlacementError, match=free):
            ray_llm(None, startup_timeout_s=2)
        assert time.monotonic() - start < 10
    finally:
        remove_placement_group(held)
    assert leftovers([]) == []


def test_the_ray_backend_without_ray_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'pagedserve\[ray\]'"):
        EngineArgs(model="m", distributed_executor_backend="ray").validate()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"external_workers": True}, "external_workers does not go with"),
        ({"dist_init": "tcp://h:1"}, "dist_init does not go with"),
        ({"device": "cuda:1"}, "Ray gives each rank its GPU"),
        ({"placement_strategy": "spread"}, "placement_strategy must be"),
        ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend must be"),
        ({"distributed_executor_backend": "mp", "ray_address": "auto"}, "ray_address needs"),
    ],
    ids=["external", "dist-init", "cuda-n", "strategy", "backend", "address-without-ray"],
)
def test_ray_settings_that_cannot_work_fail_before_any_process_starts(
    settings: dict, message: str
) -> None:
    args = {"model": "m", "distributed_executor_backend": "ray", **settings}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**args).validate()


def test_the_ray_flags_reach_their_engine_args_fields() -> None:
    argv = ["generate", "--input", "i", "--output", "o", "--distributed-executor-backend"]
    argv += ["ray", "--placement-strategy", "SPREAD", "--ray-address", "auto", "--tp", "2"]
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs["distributed_executor_backend"] == "ray"
    assert kwargs["placement_strategy"] == "SPREAD" and kwargs["ray_address"] == "auto"


def test_sigterm_mid_run_stops_the_engine_and_the_ray_it_started(tmp_path: Path) -> None:
    """`generate` on a new local Ray of its own (apart from the test cluster): SIGTERM
    while it generates ends it with 143, and no Ray process, actor or core is left."""
    inp = tmp_path / "in.jsonl"
    line = {"prompt_token_ids": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True}
    inp.write_text(json.dumps(line) + "\n")
    # Ray's session files and sockets go under TMPDIR: a short path (unix socket paths are
    # short), and every process of this Ray names it on its command line.
    tmp = tempfile.mkdtemp(prefix="psray-", dir="/tmp")
    flags = ["--distributed-executor-backend", "ray", "--ray-address", "local", "--tp", "2"]
    flags += ["--num-gpu-blocks", "300", "--log-level", "INFO"]
    proc = subprocess.Popen(
        generate_cmd(inp, tmp_path / "out.jsonl", *flags),
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "TMPDIR": tmp, "PYTHONPATH": str(ROOT)},
    )
    watch = StderrWatch(proc)
    try:
        watch.wait_for(r"KV cache: \d+ blocks")
        ours = processes_mentioning(tmp)
        assert len(ours) >= 4, ours  # at least Ray's head processes and the two actors
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, watch.join()
        stderr = watch.join()
        assert "interrupted" in stderr and "Traceback" not in stderr, stderr
        assert all_gone(ours + processes_mentioning(tmp), timeout=20), "left after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
