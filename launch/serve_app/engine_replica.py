"""The engine deployment: each Serve replica owns one engine (its core and workers, started
as `pagedserve serve` starts them) and the same OpenAI app over it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

from launch.client.async_llm import AsyncLLM
from launch.openai.run_server import open_engine, openai_server
from launch.serve_app.app_args import AppArgs
from launch.serve_app.forwarding import ForwardedRequest, run_app

log = logging.getLogger("pagedserve.serve_app")

# routing_stats keys: where this replica's KV events can be read (prefix_router.py).
EVENTS_KEY = "kv_events_endpoint"
REPLAY_KEY = "kv_events_replay_endpoint"


class EngineReplica:
    """One engine and its API; Serve calls __call__ per request (through the ingress),
    check_health and record_routing_stats periodically, __del__ at shutdown."""

    async def __init__(self, app_args: AppArgs) -> None:
        kwargs = dict(app_args.engine)
        if app_args.prefix_aware_routing:
            # Reachable from the router on any node: this node's address, free ports.
            ip = ray.util.get_node_ip_address()
            kwargs["kv_events_endpoint"] = f"tcp://{ip}:0"
            kwargs["kv_events_replay_endpoint"] = f"tcp://{ip}:0"
        self.engine: AsyncLLM = open_engine(app_args.cli, kwargs)
        try:
            await self.engine.start()
        except BaseException:
            await self.engine.aclose()  # Serve retries the replica: leave no process
            raise
        self.api = openai_server(self.engine, app_args.model_names, app_args.cli)
        self.app = self.api.app()
        ready = self.engine.engine.ready
        self._stats = {
            EVENTS_KEY: ready.kv_events_endpoint,
            REPLAY_KEY: ready.kv_events_replay_endpoint,
        }

    async def __call__(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any]]:
        async for message in run_app(self.app, request):
            yield message

    def record_routing_stats(self) -> dict[str, Any]:
        return self._stats

    def check_health(self) -> None:
        # A dead engine fails its requests (503 naming why); Serve then replaces the replica.
        if self.engine.dead_reason is not None:
            raise RuntimeError(f"the engine stopped: {self.engine.dead_reason}")

    async def __del__(self) -> None:
        await self.engine.aclose()
