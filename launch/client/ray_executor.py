"""Tensor-parallel workers as Ray actors (`--distributed-executor-backend ray`).

Ray places and supervises: one placement group per engine, one bundle per rank (a GPU
per rank on GPU nodes, a CPU otherwise), each actor running the worker's main loop with
the WorkerConfig a spawned worker gets. The data path does not change: steps reach the
workers over ZeroMQ at the core's TCP address on this node, tensors move over
torch.distributed, meeting at rank 0's node. `ray` is imported only when this backend
is chosen, so the default install needs none of it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any, Literal

import msgspec

from launch.client.signals import STOP_SIGNALS
from protocol.config import WorkerConfig

log = logging.getLogger("pagedserve.launch")

INSTALL_HINT = "pip install 'pagedserve[ray]'"
# Ray's placement strategies, with Ray's meaning: PACK and SPREAD are preferences,
# the STRICT ones are requirements (one node for all ranks, a node per rank).
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
# While bundles wait for resources that other jobs hold, how often the wait is logged.
WAIT_LOG_S = 10.0
# Shutdown: how long a killed actor's death may take to be confirmed.
ACTOR_EXIT_S = 5.0


_engines = itertools.count()


class RayPlacementError(ValueError):
    """Ray is missing, or its cluster cannot hold the engine's bundles."""


def import_ray() -> ModuleType:
    """The ray module, or RayPlacementError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayPlacementError(
            f"--distributed-executor-backend ray needs Ray: {INSTALL_HINT}"
        ) from None
    return ray


@dataclass(frozen=True)
class RankPlace:
    """Where Ray put a rank: its node and the actor's process there."""

    node_id: str
    ip: str
    pid: int

    def describe(self) -> str:
        # Ray's node ids are long hex strings; eight characters tell a cluster's apart.
        return f"Ray node {self.node_id[:8]} at {self.ip}"


class RankActor:
    """The body of a rank's actor: says where it runs, then serves as a worker."""

    def where(self) -> tuple[str, str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self, avoid: list[int]) -> int:
        """A port free on this node now and not in avoid (ports the core picked but has not
        bound yet, on the same host when rank 0 shares the core's node): rank 0's
        torch.distributed store binds it next."""
        with contextlib.ExitStack() as held:
            for _ in range(100):
                s = held.enter_context(socket.socket())
                s.bind(("", 0))
                port = int(s.getsockname()[1])
                if port not in avoid:
                    return port
        raise RayPlacementError(f"no free port outside {avoid} on this node")

    def run(self, config: bytes) -> int:
        """The worker's main loop (worker/main.py) until the core says stop; its exit status."""
        from worker.main import run

        return run(msgspec.json.decode(config, type=WorkerConfig))


class RayRank:
    """A rank's actor as the launcher watches a process: poll, terminate, kill, wait."""

    def __init__(self, ray: ModuleType, actor: Any, place: RankPlace, config: WorkerConfig):
        self._ray = ray
        self.actor = actor
        self.place = place
        self.pid = place.pid  # on its node
        self.returncode: int | None = None
        self.reason = ""  # why it ended, when not by the core's leave
        self.running = actor.run.remote(msgspec.json.encode(config))

    def poll(self) -> int | None:
        """Its exit status once the main loop ended or the actor died, else None."""
        if self.returncode is None:
            ready, _ = self._ray.wait([self.running], timeout=0)
            if ready:
                self._settle()
        return self.returncode

    def _settle(self) -> None:
        try:
            self.returncode = int(self._ray.get(self.running))
        except Exception as e:  # the actor died, or the loop raised: Ray's error says which
            self.returncode = 1
            self.reason = _first_cause(str(e))

    def terminate(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(self.actor, no_restart=True)

    kill = terminate

    def wait(self, timeout: float | None = ACTOR_EXIT_S) -> int:
        """Its exit status; one that does not end within timeout counts as killed here."""
        if self.returncode is None:
            ready, _ = self._ray.wait([self.running], timeout=timeout)
            if ready:
                self._settle()
            else:
                self.returncode, self.reason = 1, "stopped by the launcher"
        return self.returncode

    def exit_status(self) -> str:
        """Its end in words, naming its node."""
        why = f": {self.reason}" if self.reason else f" with exit status {self.returncode}"
        return f"ended on {self.place.describe()}{why}"


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Around ray.init: a stop signal waits until it returns (interrupted halfway, Ray's
    client crashes the process as it exits), a second one is not held; the process's
    own handlers are back afterwards. ray.init replaces SIGTERM's handler with one that
    exits at once: a SIGTERM within the call still does that (nothing is left behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def hold(signum: int, _frame: FrameType | None) -> None:
        if held:  # asked twice: stop waiting for Ray
            restore()
            signal.raise_signal(signum)
        held.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        restore()
        if held:
            signal.raise_signal(held[0])  # now handled as the process handles it


def _first_cause(text: str) -> str:
    """Ray's error in one line: its closing sentence (why the actor died) if it has one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    because = [line for line in lines if "because" in line]
    return (because or lines or ["the actor failed"])[-1]


def free_port_run(host: str, count: int) -> int:
    """A base port such that base..base+count-1 are free on host now. The core binds them
    moments later; one taken in between fails its start naming the address."""
    for _ in range(100):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind((host, 0))
            base = int(first.getsockname()[1])
            if base + count > 65536:
                continue
            try:
                for port in range(base + 1, base + count):
                    held.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise RayPlacementError(f"no run of {count} free ports found on {host}")


class RayWorkers:
    """One engine's ranks on a Ray cluster: a placement group and an actor per rank.

    Made cheaply, then place() and launch(); shutdown() undoes whatever part happened,
    so a failure or a signal at any moment leaves no actor or placement group. Several
    engines in one program (data-parallel replicas) each make one; such a program joins
    Ray itself first (ray.init), so that no engine's shutdown disconnects the others."""

    def __init__(
        self,
        world_size: int,
        device: str,
        strategy: PlacementStrategy,
        address: str | None,
        timeout_s: float,
        name: str | None = None,
    ) -> None:
        self.world_size = world_size
        self.device = device
        self.strategy = strategy
        self.address = address
        self.timeout_s = timeout_s
        # The placement group's name in Ray's listings, unique per engine.
        self.name = name or f"pagedserve-{os.getpid()}-{next(_engines)}"
        self.ray: ModuleType | None = None
        self._connected_here = False  # this engine called ray.init: it disconnects too
        self.group: Any = None
        self.actors: list[Any] = []
        self.places: list[RankPlace] = []
        self.ranks: dict[str, RayRank] = {}
        self.core_ports: list[int] = []

    # -- start-up ---------------------------------------------------------------------
    def place(self) -> None:
        """Join (or start) the cluster, reserve a bundle per rank, start the actors."""
        ray = self.ray = import_ray()
        self._connect(ray)
        bundle = self.bundle(ray.cluster_resources())
        self._check_fits(ray, bundle)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.group = placement_group(
            [dict(bundle) for _ in range(self.world_size)], strategy=self.strategy, name=self.name
        )
        self._wait_placed(ray, bundle)
        remote = ray.remote(RankActor)
        gpus = bundle.get("GPU", 0.0)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=rank
            )
            self.actors.append(
                remote.options(
                    num_cpus=bundle.get("CPU", 0.0), num_gpus=gpus, scheduling_strategy=strategy
                ).remote()
            )
        try:
            wheres = ray.get([a.where.remote() for a in self.actors], timeout=self.timeout_s)
        except Exception as e:  # an actor that cannot start: Ray's error says why
            raise RayPlacementError(
                f"the worker actors did not start ({_first_cause(str(e))}): is pagedserve "
                f"installed on every node, the same version ({INSTALL_HINT})?"
            ) from None
        self.places = [RankPlace(*w) for w in wheres]
        for rank, p in enumerate(self.places):
            log.info("worker rank %d: %s, pid %d", rank, p.describe(), p.pid)

    def _connect(self, ray: ModuleType) -> None:
        if ray.is_initialized():
            return  # the program joined a cluster itself: it stays joined after us
        self._connected_here = True  # ray.shutdown() from now on, even if init fails
        try:
            with _stop_signals_held():
                # None: RAY_ADDRESS, else the cluster `ray start` left on this machine,
                # else a new local one; "auto" joins a running cluster or fails.
                ray.init(address=self.address, include_dashboard=False, log_to_driver=True)
        except ConnectionError as e:
            raise RayPlacementError(f"cannot join a Ray cluster at {self.address!r}: {e}") from None

    def bundle(self, cluster: dict[str, float]) -> dict[str, float]:
        """One rank's resources: a GPU on a cluster with GPUs (unless the device is the
        CPU), else a CPU."""
        if self.device == "cpu" or (self.device == "auto" and cluster.get("GPU", 0) < 1):
            return {"CPU": 1.0}
        return {"GPU": 1.0}

    def _check_fits(self, ray: ModuleType, bundle: dict[str, float]) -> None:
        """RayPlacementError at once when the cluster, empty, could not hold the bundles."""
        ((kind, need),) = bundle.items()
        per_node = [int(n["Resources"].get(kind, 0) // need) for n in ray.nodes() if n.get("Alive")]
        n = self.world_size
        if self.strategy == "STRICT_PACK":
            most = max(per_node, default=0)
            fits, room = most >= n, f"at most {most} on one node"
        elif self.strategy == "STRICT_SPREAD":
            nodes = sum(1 for k in per_node if k)
            fits, room = nodes >= n, f"one on each of {nodes} node(s)"
        else:
            fits, room = sum(per_node) >= n, f"{sum(per_node)} in all"
        if not fits:
            raise RayPlacementError(
                f"the Ray cluster cannot place {n} bundle(s) of {{{_brief(bundle)}}} "
                f"({self.strategy}, one per tensor-parallel rank): its {len(per_node)} "
                f"node(s) hold {room}; add {kind} nodes or lower --tensor-parallel-size"
            )

    def _wait_placed(self, ray: ModuleType, bundle: dict[str, float]) -> None:
        """Wait for the bundles (other jobs may hold the resources), at most timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        ready = self.group.ready()
        while True:
            wait = min(WAIT_LOG_S, deadline - time.monotonic())
            if wait > 0 and ray.wait([ready], timeout=wait)[0]:
                return
            if time.monotonic() >= deadline:
                raise RayPlacementError(
                    f"the Ray cluster did not free {self.world_size} bundle(s) of "
                    f"{{{_brief(bundle)}}} ({self.strategy}) within {self.timeout_s:g} s "
                    f"(--worker-timeout): available now: {_brief(ray.available_resources())}"
                )
            log.warning(
                "waiting for Ray to free %d bundle(s) of {%s}; available: %s",
                self.world_size,
                _brief(bundle),
                _brief(ray.available_resources()),
            )

    def all_on_this_node(self) -> bool:
        """Whether every rank runs on the Ray node of this process."""
        assert self.ray is not None
        here = self.ray.get_runtime_context().get_node_id()
        return all(p.node_id == here for p in self.places)

    def core_address(self) -> str:
        """Where the core listens for the ranks: this node's IP, free ports."""
        assert self.ray is not None
        host = self.ray.util.get_node_ip_address()
        base = free_port_run(host, self.world_size + 1)
        self.core_ports = list(range(base, base + self.world_size + 1))
        return f"tcp://{host}:{base}"

    def rendezvous(self) -> str:
        """torch.distributed's meeting point: a free port on rank 0's node."""
        assert self.ray is not None
        port = self.ray.get(
            self.actors[0].free_port.remote(self.core_ports), timeout=self.timeout_s
        )
        return f"tcp://{self.places[0].ip}:{port}"

    def launch(self, configs: list[WorkerConfig]) -> dict[str, RayRank]:
        """Start every rank's main loop; the ranks by the names the launcher uses."""
        assert self.ray is not None
        for rank, config in enumerate(configs):
            self.ranks[f"worker rank {rank}"] = RayRank(
                self.ray, self.actors[rank], self.places[rank], config
            )
        return self.ranks

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every actor, remove the placement group, leave the cluster if this engine
        joined it. Safe at any point of start-up, and twice."""
        ray = self.ray
        if ray is None:
            return
        if ray.is_initialized():
            self._remove(ray)
        if self._connected_here:
            ray.shutdown()  # harmless after a half-done init
            self._connected_here = False

    def _remove(self, ray: ModuleType) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.actors:
            # Each rank's loop and a call to each actor end once Ray has marked it dead:
            # one wait for all, bounded (a lost node's are known only when Ray notices).
            refs = [r.running for r in self.ranks.values()]
            refs += [a.where.remote() for a in self.actors]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=ACTOR_EXIT_S)
        for rank in self.ranks.values():
            rank.wait(timeout=0)  # its status kept for the failure message
        self.actors = []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
            self.group = None


def _brief(resources: dict[str, float]) -> str:
    """CPU, GPU and custom resources; Ray's per-node bookkeeping entries left out."""
    shown = {k: v for k, v in resources.items() if not k.startswith("node:") and "memory" not in k}
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) or "nothing"
