"""The Serve application's arguments: `pagedserve serve`'s own flags (its parser checks them
and sets their defaults, so the two never drift) plus Ray Serve's deployment options."""

from __future__ import annotations

import argparse
import contextlib
import io
import secrets
from dataclasses import dataclass
from typing import Any

from launch.cli_flags import build_parser, engine_kwargs
from launch.openai.run_server import flag_error, served_names

# Passed to Serve as they are (its own schema checks them); the rest are server flags.
DEPLOYMENT_OPTIONS = (
    "num_replicas",
    "autoscaling_config",
    "max_ongoing_requests",
    "max_queued_requests",
    "ray_actor_options",
    "health_check_period_s",
    "health_check_timeout_s",
    "graceful_shutdown_timeout_s",
)
# Ours, beside the flags: the router's switch and its load bound, the ingress replicas.
APP_OPTIONS = ("prefix_aware_routing", "max_load_imbalance", "ingress_replicas")
# Serve owns the HTTP listener (its http_options), TLS and connection limits, and a
# replica's shutdown (graceful_shutdown_timeout_s); a worker placed by hand has no place in
# a replica. A seed travels from a file or the environment only, as on the command line.
NOT_IN_SERVE = {
    "host": "set Serve's http_options (host, port) instead",
    "port": "set Serve's http_options (host, port) instead",
    "ssl_keyfile": "Serve's proxy terminates HTTP: put TLS in front of it",
    "ssl_certfile": "Serve's proxy terminates HTTP: put TLS in front of it",
    "ssl_ca_certs": "Serve's proxy terminates HTTP: put TLS in front of it",
    "ssl_cert_reqs": "Serve's proxy terminates HTTP: put TLS in front of it",
    "root_path": "set Serve's route_prefix instead",
    "shutdown_timeout": "set the deployment's graceful_shutdown_timeout_s instead",
    "max_connections": "Serve's proxy holds the connections",
    "timeout_keep_alive": "Serve's proxy holds the connections",
    "timeout_request_head": "Serve's proxy holds the connections",
    "timeout_request_body": "Serve's proxy holds the connections",
    "external_workers": "each replica starts its own workers",
    "worker_address": "each replica starts its own workers",
    "dist_init": "each replica starts its own workers",
    "record": "replicas would share one recording folder",
    "prefix_cache_hash_seed": "give prefix_cache_hash_seed_file (a path on every node) or "
    "the environment variable of `pagedserve serve`",
}
DEFAULT_MAX_LOAD_IMBALANCE = 8


@dataclass(frozen=True)
class AppArgs:
    """Everything a replica needs, checked once where the application is built."""

    cli: argparse.Namespace  # `pagedserve serve`'s parsed flags
    engine: dict[str, Any]  # EngineArgs fields, as the CLI derives them
    deployment: dict[str, Any]  # Serve options of the engine deployment
    prefix_aware_routing: bool
    max_load_imbalance: int
    ingress_replicas: int

    @property
    def model_names(self) -> list[str]:
        return served_names(self.cli)


def parse_app_args(args: dict[str, Any]) -> AppArgs:
    """`serve run launch.ray_serve:build_app key=value ...` or a config file's `args:`.
    Keys are `pagedserve serve`'s flags with underscores (tensor_parallel_size=2); values
    are strings from the command line or YAML values. ValueError names the culprit."""
    if not isinstance(args, dict):
        raise ValueError(f"the application's args must be a mapping, not {type(args).__name__}")
    rest = dict(args)
    deployment = {k: rest.pop(k) for k in DEPLOYMENT_OPTIONS if k in rest}
    for key in ("num_replicas", "max_ongoing_requests"):
        # `serve run ... num_replicas=2` passes strings; "auto" is Serve's own choice.
        if isinstance(deployment.get(key), str) and deployment[key] != "auto":
            deployment[key] = _count(deployment[key], key, 1)
    own = {k: rest.pop(k) for k in APP_OPTIONS if k in rest}
    for key in rest:
        if key.replace("-", "_") in NOT_IN_SERVE:
            raise ValueError(f"{key} does not apply under Ray Serve: {NOT_IN_SERVE[key]}")
    cli = _parse_flags(rest)
    error = flag_error(cli)
    if error is not None:
        raise ValueError(f"pagedserve Serve application: {error.removeprefix('--')}")
    kwargs = engine_kwargs(cli)
    routing = _flag_bool(own.get("prefix_aware_routing", True), "prefix_aware_routing")
    if kwargs["prefix_cache_hash_seed"] is None:
        # One secret for every replica, so that their block hashes (hence the router's
        # scores) agree; made here, once, where the application is built.
        kwargs["prefix_cache_hash_seed"] = secrets.token_hex(16)
    if routing and cli.no_prefix_caching:
        raise ValueError("prefix_aware_routing needs prefix caching: drop no_prefix_caching")
    if routing and cli.kv_events_endpoint is not None:
        raise ValueError(
            "kv_events_endpoint: with prefix_aware_routing each replica publishes its events "
            "on its own node's address; set prefix_aware_routing: false to choose them"
        )
    return AppArgs(
        cli=cli,
        engine=kwargs,
        deployment=deployment,
        prefix_aware_routing=routing,
        max_load_imbalance=_count(
            own.get("max_load_imbalance", DEFAULT_MAX_LOAD_IMBALANCE), "max_load_imbalance"
        ),
        ingress_replicas=_count(own.get("ingress_replicas", 1), "ingress_replicas", 1),
    )


def _parse_flags(values: dict[str, Any]) -> argparse.Namespace:
    argv = ["serve"]
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False or value == "false":
            continue
        if value is True or value == "true":
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            raise ValueError(f"{key}: a flag takes a value or a list, not a mapping")
        else:
            argv += [flag, str(value)]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        # argparse's last line says what is wrong, in the flag's words.
        lines = err.getvalue().strip().splitlines()
        why = lines[-1].split("error: ", 1)[-1] if lines else "bad arguments"
        raise ValueError(f"pagedserve Serve application: {why}") from None


def _flag_bool(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{name} must be true or false, not {value!r}")


def _count(value: object, name: str, minimum: int = 0) -> int:
    try:
        n = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        n = minimum - 1
    if isinstance(value, bool) or n < minimum or str(n) != str(value).strip():
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}")
    return n
