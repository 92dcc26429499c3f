"""The OpenAI-compatible server as a Ray Serve application (docs/deploy.md, "Ray Serve"):

    serve run launch.ray_serve:build_app model=/models/llama tensor_parallel_size=2

or `import_path: launch.ray_serve:build_app` in a Serve config file, with the same keys
under `args:`. Two deployments: an ingress that takes the HTTP requests, and the engine
deployment, whose every replica owns one engine and runs the same app as `pagedserve
serve`; a prefix-aware request router (launch/serve_app/prefix_router.py) picks the
engine replica for each request."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from launch.serve_app.app_args import AppArgs, parse_app_args
from launch.serve_app.engine_replica import EngineReplica
from launch.serve_app.ingress import Ingress

ENGINE_DEPLOYMENT = "PagedServeEngine"
INGRESS_DEPLOYMENT = "PagedServeIngress"
# Replicas report where their KV events are this often; a new replica is scored from its
# first report on (before it, it is routed by load).
ROUTING_STATS_PERIOD_S = 2.0
ROUTER_CLASS = "launch.serve_app.prefix_router:PrefixAwareRouter"


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are `pagedserve serve`'s flags (underscored),
    Serve's num_replicas / autoscaling_config / max_ongoing_requests / ray_actor_options
    for the engine deployment, prefix_aware_routing (default true), max_load_imbalance
    and ingress_replicas. ValueError names a bad one before anything starts."""
    app_args = parse_app_args(args)
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT, **_engine_options(app_args)
    )
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=app_args.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(app_args), app_args)


def _engine_options(app_args: AppArgs) -> dict[str, Any]:
    options = dict(app_args.deployment)
    if "ray_actor_options" not in options:
        options["ray_actor_options"] = _replica_resources(app_args)
    if app_args.prefix_aware_routing:
        keys = app_args.cli.zmq_curve_keys
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "max_load_imbalance": app_args.max_load_imbalance,
                "zmq_curve_keys": None if keys is None else str(keys),
            },
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    return options


def _replica_resources(app_args: AppArgs) -> dict[str, Any]:
    """A replica's workers are its children (the mp executor), so it holds their GPUs:
    one per tensor-parallel rank, which Ray then makes the replica's visible devices."""
    cli = app_args.cli
    if cli.device == "cpu" or cli.distributed_executor_backend == "ray":
        return {"num_cpus": 1}
    if cli.device == "auto" and not _cluster_has_gpus():
        return {"num_cpus": 1}
    return {"num_cpus": 1, "num_gpus": cli.tensor_parallel_size}


def _cluster_has_gpus() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
