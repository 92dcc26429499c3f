"""The engine's flags for where its workers run and how they meet: tensor parallelism,
CPU placement, external workers, and the Ray executor (generate, serve, run-batch)."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from launch.client.engine_args import EngineArgs, ExecutorBackend
from launch.client.ray_executor import INSTALL_HINT, PlacementStrategy
from launch.flag_types import positive
from protocol.cpu_placement import CpuPlacement


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    """Where the workers run and how they meet."""
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=positive("--tensor-parallel-size"),
        default=EngineArgs.tensor_parallel_size,
    )
    p.add_argument(
        "--cpu-placement",
        choices=get_args(CpuPlacement),
        default=EngineArgs.cpu_placement,
        help="CPU workers only. shared (default): every process on any core, the worker's "
        "thread count tuned while it runs; reserve: the API server and engine core get "
        "--cpu-reserved-cores cores, each worker the rest, one thread per core",
    )
    p.add_argument(
        "--cpu-reserved-cores",
        type=positive("--cpu-reserved-cores"),
        default=EngineArgs.cpu_reserved_cores,
        help="cores kept for the API server and engine core with --cpu-placement reserve",
    )
    p.add_argument(
        "--external-workers",
        action="store_true",
        help="wait for N `pagedserve worker` processes instead of spawning them",
    )
    p.add_argument(
        "--worker-address",
        help="where the core listens for workers "
        "(tcp://HOST:PORT or ipc://PATH; port 0: the core picks free ports and logs "
        "the address; default: private ipc, or tcp://127.0.0.1:29550 with --external-workers)",
    )
    p.add_argument(
        "--dist-init",
        help="torch.distributed rendezvous for TP workers "
        "(tcp://HOST:PORT, or file://PATH on one machine; default: a file in the "
        "engine's private directory)",
    )
    _add_ray_flags(p)
    p.add_argument(
        "--data-parallel-size",
        "--dp",
        type=positive("--data-parallel-size"),
        default=EngineArgs.data_parallel_size,
        help="serve and run-batch: this many whole engines (a core and its TP workers "
        "each) behind one server that sends each request to the replica caching most of "
        "its prompt (docs/deploy.md)",
    )
    p.add_argument(
        "--data-parallel-backend",
        choices=get_args(ExecutorBackend),
        help="who starts the replicas' workers (default: --distributed-executor-backend); "
        "ray: actors, a placement group per replica",
    )


def _add_ray_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--distributed-executor-backend",
        choices=get_args(ExecutorBackend),
        default=EngineArgs.distributed_executor_backend,
        help="who starts the workers. mp: processes on this machine; ray: actors on a Ray "
        f"cluster, one placement-group bundle per rank ({INSTALL_HINT}; docs/deploy.md)",
    )
    p.add_argument(
        "--placement-strategy",
        choices=get_args(PlacementStrategy),
        default=EngineArgs.placement_strategy,
        help="with ray: how the ranks' bundles (a GPU each, else a CPU) spread over nodes. "
        "PACK: few nodes if possible; SPREAD: different nodes if possible; STRICT_PACK: "
        "one node or fail; STRICT_SPREAD: a node per rank or fail (default: %(default)s)",
    )
    p.add_argument(
        "--ray-address",
        help="with ray: the cluster to join (auto: the one running on this machine, or "
        "fail; HOST:PORT: its head; local: a new local Ray for this engine). Default: "
        "RAY_ADDRESS, else a cluster started on this machine, else a new local one",
    )


def distributed_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields these flags set."""
    return dict(
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_placement=args.cpu_placement,
        cpu_reserved_cores=args.cpu_reserved_cores,
        external_workers=args.external_workers,
        worker_address=args.worker_address,
        dist_init=args.dist_init,
        distributed_executor_backend=args.distributed_executor_backend,
        placement_strategy=args.placement_strategy,
        ray_address=args.ray_address,
        data_parallel_size=args.data_parallel_size,
        data_parallel_backend=args.data_parallel_backend,
    )
