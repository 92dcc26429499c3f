"""`pagedserve serve`: the engine behind the OpenAI-compatible API, on uvicorn.

Order of life: bind the port (a taken port fails before the engine starts), start the
engine processes, serve. It ends in order too: on SIGINT, SIGTERM or SIGHUP every open
request is aborted (streams end with an error event), uvicorn closes its connections,
then the engine stops its workers and exits; status 0. If an engine process dies, open
streams end with an error naming it and the server exits with status 1 within a few
seconds. Children never outlive us (they also watch our pid).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import Any

import uvicorn

from launch.client.async_llm import AsyncLLM
from launch.client.data_parallel import DataParallelLLM
from launch.client.engine_processes import EngineDeadError
from launch.client.signals import STOP_SIGNALS, Terminated, hurried, hurry, restore_handlers
from launch.openai.api_server import CORS, OpenAIServer
from launch.openai.connections import MAX_HEAD_BYTES, ConnectionLimits, guarded_protocol
from launch.openai.metrics import STATS_LOGGER, StatsLog
from launch.openai.tool_parsers import TOOL_CALL_PARSERS
from protocol.gc_heap import freeze_startup_heap

log = logging.getLogger("pagedserve.serve")

# After the engine died, or a stop signal, how long open connections may take to end.
GRACEFUL_S = 3
# How long a thread preparing a request (a chat template renders in Python) keeps the GIL
# while the event loop waits for it: the loop wants it many times to answer one request,
# so 1 ms (Python's default is 5) keeps /health quick.
SWITCH_INTERVAL_S = 0.001
# How often a draining server looks whether its open requests have finished.
DRAIN_POLL_S = 0.05


class _Server(uvicorn.Server):
    """uvicorn, with our own signal handling: a stop signal aborts open requests so
    their streams end now (after draining them for up to drain_s: new requests get 503
    meanwhile), and is not re-raised after shutdown (uvicorn would). A second signal
    ends the drain and hurries the engine's shutdown; no signal interrupts it."""

    def __init__(
        self, config: uvicorn.Config, api: OpenAIServer, name: str, drain_s: float = 0.0
    ) -> None:
        super().__init__(config)
        self.api = api
        self.engine = api.engine
        self.name = name
        self.drain_s = drain_s
        self.stop_signal: int | None = None
        self.engine_died: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            # Serving is over: a stop signal from here on only hurries the engine's shutdown.
            restore_handlers(previous)

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        first = self.stop_signal is None
        self.stop_signal = sig
        if first and self.drain_s > 0 and self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain)
            return
        if not first:
            # A second signal ends the drain and hurries the engine's processes. Not
            # uvicorn's force_exit: that skips the lifespan's end, which stops the engine.
            hurry()
        self.should_exit = True
        if self._loop is not None:
            # Not from inside the handler: it may interrupt the loop between two steps
            # of starting a request.
            self._loop.call_soon_threadsafe(self.engine.abort_all)

    def _drain(self) -> None:
        self.api.draining = True
        log.info(
            "stopping: no new requests; %d open ones may finish within %g s",
            self.engine.num_open_requests,
            self.drain_s,
        )
        asyncio.get_running_loop().create_task(self._stop_when_drained())

    async def _stop_when_drained(self) -> None:
        deadline = time.monotonic() + self.drain_s
        while self.engine.num_open_requests and time.monotonic() < deadline:
            if self.should_exit:  # a second signal, or the engine died
                return
            await asyncio.sleep(DRAIN_POLL_S)
        self.should_exit = True
        self.engine.abort_all()  # what did not finish in time

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            scheme = "https" if self.config.is_ssl else "http"
            print(f"pagedserve serve: {self.name} on {scheme}://{host}:{port}", file=sys.stderr)
            asyncio.get_running_loop().create_task(self._watch_engine())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ender = asyncio.get_running_loop().create_task(self._end_open_requests())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_open_requests(self) -> None:
        """Open requests were aborted, but an engine stuck in a step cannot answer: end
        the rest before uvicorn's grace period cancels them (it logs a traceback)."""
        deadline = time.monotonic() + GRACEFUL_S / 2
        while self.engine.num_open_requests and time.monotonic() < deadline and not hurried():
            await asyncio.sleep(DRAIN_POLL_S)
        self.engine.fail_open(EngineDeadError("the server is stopping; the engine did not answer"))

    async def _watch_engine(self) -> None:
        self.engine_died = await self.engine.wait_dead()
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def serve(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """0 after a stop signal; 1 if the engine failed; 2 for bad settings."""
    error = flag_error(args) or _tls_error(args)
    if error is not None:
        print(f"pagedserve serve: {error}", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"pagedserve serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    engine = None
    try:
        engine = open_engine(args, engine_kwargs)
        names = served_names(args)
        api = openai_server(engine, names, args)
        server = _Server(_config(api, engine, args), api, names[0], args.shutdown_timeout)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        server.run(sockets=[sock])
    except (ValueError, EngineDeadError) as e:
        print(f"pagedserve serve: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated):
        return 0  # during start-up: EngineProcesses stopped what it had started
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()
    if server.engine_died is not None:
        print(f"pagedserve serve: {server.engine_died}", file=sys.stderr)
        return 1
    return 0


def flag_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the server's flags beyond their parsers (checked before the
    engine starts; a Serve application checks the same), or None."""
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        return "--max-waiting-requests must be >= 0"
    if not args.log_stats_interval > 0:
        return "--log-stats-interval must be > 0"
    if not args.shutdown_timeout >= 0:
        return "--shutdown-timeout must be >= 0"
    if args.max_stored_responses < 0:
        return "--max-stored-responses must be >= 0"
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parsers = ", ".join(TOOL_CALL_PARSERS)
        return f"--enable-auto-tool-choice needs --tool-call-parser ({parsers})"
    if args.api_key is not None and not args.api_key.strip():
        # An empty key would let anyone in who sends "Bearer ": refuse it instead.
        return "--api-key is empty (unset it for no key)"
    return None


def open_engine(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> AsyncLLM:
    """The engine behind the API (serve, run-batch): its processes started, not joined."""
    engine_class = AsyncLLM if engine_kwargs.get("data_parallel_size", 1) == 1 else DataParallelLLM
    return engine_class(
        args.model,
        log_level=args.log_level,
        chat_template=args.chat_template,
        stream_interval=args.stream_interval,
        **engine_kwargs,
    )


def served_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name's names, else the model as given (or the built-in's name)."""
    return args.served_model_name or [args.model or "pagedserve-builtin"]


def openai_server(engine: AsyncLLM, names: list[str], args: argparse.Namespace) -> OpenAIServer:
    """The API over `engine` as `pagedserve serve`'s flags set it (also each Serve replica's)."""
    return OpenAIServer(
        engine,
        names[0],
        args.max_waiting_requests,
        args.api_key,
        args.tool_call_parser,
        args.max_stored_responses,
        args.reasoning_parser,
        aliases=names[1:],
        responses_store_bytes=args.responses_store_bytes,
        strict_fields=args.strict_request_fields,
        max_body_bytes=args.max_request_body_bytes,
        cors=None
        if args.allowed_origins is None
        else CORS(
            args.allowed_origins,
            args.allowed_methods,
            args.allowed_headers,
            args.allow_credentials,
        ),
    )


def _config(api: OpenAIServer, engine: AsyncLLM, args: argparse.Namespace) -> uvicorn.Config:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await engine.start()
        freeze_startup_heap()  # the app, the tokenizer and the engine client are up
        stats = None
        if not args.disable_log_stats:
            stats = asyncio.get_running_loop().create_task(
                _log_stats(StatsLog(api.metrics), args.log_stats_interval)
            )
        yield
        if stats is not None:
            stats.cancel()
        await engine.aclose()  # after uvicorn closed its connections

    return uvicorn.Config(
        api.app(lifespan),
        loop=_loop(),
        # httptools (a dependency; h11 only where it cannot be imported), under our
        # connection limits. Both report ASGI spec 2.3 from uvicorn 0.33, so Starlette
        # watches for a client's disconnect while a stream waits for tokens, not only when
        # it next writes.
        http=guarded_protocol(
            ConnectionLimits(
                args.max_connections, args.timeout_request_head, args.timeout_request_body
            )
        ),
        timeout_keep_alive=args.timeout_keep_alive,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        lifespan="on",
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_S,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )


def _tls_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the TLS flags (checked before the engine starts), or None."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        return "--ssl-keyfile and --ssl-certfile go together"
    if args.ssl_keyfile is None and (args.ssl_ca_certs is not None or args.ssl_cert_reqs):
        return "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile"
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not path.is_file():
            return f"--{flag.replace('_', '-')} {path}: no such file"
    if args.ssl_keyfile is not None:
        try:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (ssl.SSLError, OSError) as e:
            return f"--ssl-certfile / --ssl-keyfile: {e}"
    return None


async def _log_stats(log: StatsLog, interval: float) -> None:
    # Shown at the default log level, as vLLM shows its own: it is how one sees a server
    # work (--disable-log-stats turns it off).
    STATS_LOGGER.setLevel(logging.INFO)
    while True:
        await asyncio.sleep(interval)
        line = log.line()
        if line is not None:
            STATS_LOGGER.info(line)


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"
