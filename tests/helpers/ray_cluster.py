"""Ray's own multi-node test cluster on this machine, for tests of engines on Ray: nodes of
one CPU each told apart by a custom resource (node_a, node_b...), this process the driver."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def checkout_importable() -> Iterator[None]:
    """PYTHONPATH leads with this checkout while the block runs, so the Ray processes
    started meanwhile (raylets pass it on to actors) import it."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@contextlib.contextmanager
def ray_cluster(nodes: int = 2) -> Iterator[Cluster]:
    """A cluster of `nodes` one-CPU nodes, joined; shut down (and left) at the end. The
    actors import this checkout."""
    with checkout_importable():
        yield from _cluster(nodes)


def _cluster(nodes: int) -> Iterator[Cluster]:
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node_a": 1},
            "include_dashboard": False,
            # A lost node is declared dead in about a second, not Ray's default ~15 s.
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 2},
        },
    )
    try:
        for i in range(1, nodes):
            c.add_node(num_cpus=1, resources={f"node_{chr(ord('a') + i)}": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
