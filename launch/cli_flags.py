"""The `pagedserve` command line's flags: the argparse tables of every command, their
value parsers, and how the engine's flags become EngineArgs fields."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

import msgspec

from launch.client.engine_args import DEFAULT_LOG_LEVEL, EngineArgs
from launch.client.version import package_version
from launch.distributed_flags import add_distributed_flags, distributed_kwargs
from launch.flag_types import fraction, parse_bytes, positive, ranged, seconds, string_list
from launch.openai.body_limits import DEFAULT_MAX_BODY_BYTES
from launch.openai.connections import ConnectionLimits
from launch.openai.reasoning import REASONING_PARSERS
from launch.openai.responses_store import (
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_RESPONSES_STORE_BYTES,
)
from launch.openai.tool_parsers import TOOL_CALL_PARSERS
from protocol import envs
from protocol.config import (
    DType,
    GenerationConfigMode,
    HashAlgo,
    LogLevel,
    SchedulingPolicy,
    WorkerConfig,
)

_port = ranged("--port", int, lambda v: 0 <= v <= 65535, "in [0, 65535]")


# WorkerConfig's few own defaults (settings no launcher but this one sets).
_WORKER_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(WorkerConfig)}


def _add_kv_tier_flags(p: argparse.ArgumentParser) -> None:
    """The second KV tier's flags (docs/kv_tier.md)."""
    p.add_argument(
        "--kv-offload-memory",
        type=parse_bytes("--kv-offload-memory"),
        help="host memory per worker for a second KV tier: evicted prefix-cache blocks are "
        "kept there and loaded back instead of recomputed (e.g. 8GiB; default: off)",
    )
    p.add_argument(
        "--kv-cache-dir",
        help="a disk level for the second KV tier (one file per block and rank), behind "
        "--kv-offload-memory or alone; indexed again at start-up: a restart keeps its "
        "prefix cache (with a fixed --prefix-cache-hash-seed-file)",
    )
    p.add_argument(
        "--kv-cache-dir-size",
        type=parse_bytes("--kv-cache-dir-size"),
        help="disk each worker may use under --kv-cache-dir: the disk level's capacity "
        "(default: 16GiB)",
    )
    p.add_argument(
        "--kv-tier-load-bytes",
        type=parse_bytes("--kv-tier-load-bytes"),
        help="disk tier bytes per worker one step loads for requests that load before "
        "they compute; less stalls running requests less (default: 64MiB)",
    )


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The flags both commands pass to their workers (named as WORKER_SETTINGS reads them)."""
    p.add_argument(
        "--model",
        help="a local Hugging Face checkpoint directory, or a Hub id org/name[@revision] "
        "fetched into the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply; "
        "default: the built-in model)",
    )
    p.add_argument(
        "--generation-config",
        choices=get_args(GenerationConfigMode),
        default=EngineArgs.generation_config,
        help="auto: the model's generation_config.json adds its EOS ids and gives the "
        "defaults of temperature, top-p and top-k; none: ignore that file",
    )
    p.add_argument(
        "--seed", type=int, default=EngineArgs.seed, help="engine seed (unseeded requests)"
    )
    p.add_argument("--block-size", type=positive("--block-size"), default=EngineArgs.block_size)
    p.add_argument(
        "--dtype",
        choices=get_args(DType),
        default=EngineArgs.dtype,
    )
    p.add_argument("--device", default=EngineArgs.device, help="auto, cpu or cuda")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes("--kv-cache-memory"),
        help="KV cache per worker, in bytes or with a unit (256MiB, 4GiB, 2GB); default: "
        "4 GiB on the CPU (at most a quarter of the available host memory, see "
        "docs/generate.md), on a GPU what --gpu-memory-utilization leaves",
    )
    _add_kv_tier_flags(p)
    p.add_argument(
        "--gpu-memory-utilization",
        type=fraction("--gpu-memory-utilization"),
        default=EngineArgs.gpu_memory_utilization,
        help="share of each GPU's memory a worker may hold: weights, the peak of the "
        "largest step, and the KV cache, which gets the rest; other processes' memory is "
        "not counted against it, so two engines at 0.45 share a GPU (default: %(default)s; "
        "unused on the CPU and with --kv-cache-memory)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive("--max-num-batched-tokens"),
        default=EngineArgs.max_num_batched_tokens,
        help="tokens per step (default: 8192 on a GPU, 512 on the CPU; a GPU worker "
        "profiles a step this large to size its KV cache)",
    )
    p.add_argument(
        "--prefill-tokens-per-request",
        type=ranged("--prefill-tokens-per-request", int, lambda v: v >= 0, ">= 0"),
        default=EngineArgs.prefill_tokens_per_request,
        help="in a step that decodes, at most this many prefill tokens per open request "
        "(running or waiting; at least 32): a prompt arriving beside a few decoding requests "
        "is cut into small chunks so that their inter-token latency stays bounded, a long "
        "queue still fills the step (0: no cap; default: 8 on the CPU, 0 on a GPU)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive("--max-num-seqs"),
        default=EngineArgs.max_num_seqs,
        help="requests per step",
    )


def _add_api_flags(p: argparse.ArgumentParser) -> None:
    """What the OpenAI-compatible routes need to know of the model (serve, run-batch)."""
    p.add_argument(
        "--stream-interval",
        type=positive("--stream-interval"),
        default=1,
        help="tokens per streamed chunk, but a stream's first and last (vLLM's): larger "
        "values cost the server less per token at many streams; a request's "
        "stream_interval may ask for more (default: 1, every token as it comes)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model's name in the API, then any other names requests may use for it "
        "(default: --model as given)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call format, read out of its answers: lets a chat request "
        'with tools use tool_choice "auto" (the default with tools); without it, "auto" is '
        'a 400 and "required", a named function and "none" still work',
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="the model's thinking format: its <think> block is answered apart, as "
        "`reasoning` in chat completions and a reasoning item in the Responses API, and "
        "tool calls are read from the rest (default: none, the block stays in the text)",
    )


def _add_log_level(p: argparse.ArgumentParser, processes: str) -> None:
    # Any case in, as logging spells it out: the process configs take only these names.
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=get_args(LogLevel),
        default=DEFAULT_LOG_LEVEL,
        metavar="LEVEL",
        help=f"log level of {processes}: {', '.join(get_args(LogLevel))} (default: WARNING)",
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags beyond the workers' (generate and serve share them)."""
    p.add_argument(
        "--num-gpu-blocks",
        type=positive("--num-gpu-blocks"),
        help="override the KV cache size in blocks (counts the null block)",
    )
    p.add_argument("--max-model-len", type=positive("--max-model-len"))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--hash", choices=get_args(HashAlgo), default=EngineArgs.hash_algo)
    p.add_argument(
        "--scheduling-policy",
        choices=get_args(SchedulingPolicy),
        default=EngineArgs.scheduling_policy,
        help="order of the waiting queue: fcfs (arrival) or priority (each request's "
        "priority, lower first, ties by arrival; preemption takes the lowest first)",
    )
    _add_security_flags(p)
    add_distributed_flags(p)
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=EngineArgs.startup_timeout_s,
        help="seconds to wait for every worker to report at start-up",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=EngineArgs.step_timeout_s,
        help="seconds a step may take before the run fails naming the rank (a stopped or "
        "stuck worker)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        help="publish KV-cache events (vLLM's format, docs/protocol.md) on a ZeroMQ PUB "
        "socket: tcp://*:PORT binds (tcp://HOST:0 a free port, logged), another address "
        "is a subscriber to connect to",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        help="ROUTER socket that resends buffered event batches from a sequence number",
    )
    p.add_argument(
        "--log-kv",
        action="store_true",
        help="log one line per step: each request's prefix hits, blocks per group, new "
        "blocks, and the free blocks",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=EngineArgs.async_scheduling,
        help="overlap scheduling with the model: the core sends each step while the "
        "previous one runs (default); --no-async-scheduling runs one step at a time",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="speculative decoding with drafts from the request's own tokens (vLLM's keys), "
        'e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        'or \'{"method": "suffix", "num_speculative_tokens": 8}\'; runs one step at a time',
    )
    _add_log_level(p, "engine processes")
    p.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) used instead of the "
        "model's, for chat inputs",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="record every frame the core sends its workers, and their answers, into this "
        "new directory, for `pagedserve replay DIR`",
    )


# -- secrets and socket security (docs/security.md) ---------------------------------------


def _seed_in_argv(text: str) -> str:
    raise argparse.ArgumentTypeError(
        "a seed on the command line is visible to every user of the machine (ps): put it "
        "in a file for --prefix-cache-hash-seed-file PATH, or in the environment variable "
        f"{envs.PREFIX_CACHE_HASH_SEED}"
    )


def _seed_file(text: str) -> str:
    """The seed a file holds (one trailing newline dropped); the file must be private."""
    path = Path(text)
    try:
        seed = path.read_text().removesuffix("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read the seed from {text}: {e}") from None
    if not seed:
        raise argparse.ArgumentTypeError(f"{text} is empty: write the seed into it")
    return seed


def _add_keys_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--zmq-curve-keys",
        metavar="DIR",
        default=envs.zmq_curve_keys(),
        help=f"a keys directory made by `pagedserve keys DIR`: {what} (default: "
        f"${envs.ZMQ_CURVE_KEYS}; unset: no CURVE, and a warning for a socket bound "
        "beyond loopback)",
    )


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """The hash seed, from a file or the environment only, and the CURVE keys."""
    p.add_argument("--prefix-cache-hash-seed", type=_seed_in_argv, help=argparse.SUPPRESS)
    p.add_argument(
        "--prefix-cache-hash-seed-file",
        metavar="PATH",
        type=_seed_file,
        help="a file holding the secret root of the prefix-cache block hashes (default: "
        f"${envs.PREFIX_CACHE_HASH_SEED}, else random at each start; replicas behind one "
        "KV-aware router need the same)",
    )
    _add_keys_flag(
        p,
        "every tcp:// socket of the core (workers, KV events and replay) speaks CURVE and "
        "admits only the directory's client keys",
    )


def _add_keys(sub: Any) -> None:
    """`pagedserve keys`: a new CURVE keys directory."""
    k = sub.add_parser(
        "keys",
        help="make a CURVE keys directory for --zmq-curve-keys (docs/security.md)",
    )
    k.add_argument("dir", type=Path, metavar="DIR", help="a new directory (made mode 0700)")
    k.add_argument(
        "--client",
        action="append",
        metavar="NAME",
        help="a client keypair NAME.key / NAME.key_secret to make; repeatable (default: "
        "one named client, the name workers and the examples load)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="pagedserve: a CUDA-free EngineCore that owns the KV cache, plus workers.",
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_run_batch(sub)
    _add_worker(sub)
    _add_replay(sub)
    _add_keys(sub)
    return parser


def _add_generate(sub: Any) -> None:
    """`pagedserve generate`: offline generation over a JSON-lines file."""
    g = sub.add_parser("generate", help="offline generation over a JSON-lines file")
    _add_worker_flags(g)
    g.add_argument("--input", required=True, type=Path, help="JSON lines: {'prompt': ...}")
    g.add_argument("--output", required=True, type=Path, help="JSON lines (-: stdout)")
    g.add_argument("--max-tokens", type=positive("--max-tokens"), default=16)
    g.add_argument(
        "--temperature",
        type=float,
        help="default for lines that set none (default: the model's generation_config, else "
        "1.0; below 1e-5 is greedy)",
    )
    g.add_argument("--top-p", type=float, help="likewise (else 1.0: off)")
    g.add_argument("--top-k", type=int, help="likewise (else 0: off)")
    g.add_argument(
        "--min-p",
        type=float,
        help="likewise (else 0: off): tokens less likely than this times the likeliest one "
        "are not sampled",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_engine_flags(g)


def _add_serve(sub: Any) -> None:
    """`pagedserve serve`: the OpenAI-compatible HTTP server."""
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=_port, default=8000, help="port (0: a free one, printed)")
    v.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM (or SIGINT, SIGHUP), take no new requests (503, /health 503) and "
        "let open ones finish for up to this many seconds before aborting the rest; a "
        "second signal stops at once (default: 0, abort open requests at once)",
    )
    v.add_argument(
        "--max-waiting-requests",
        type=int,
        help="answer 503 to new requests while this many wait for their first token "
        "(default: no limit)",
    )
    v.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic log line of throughput, queues, KV usage and prefix-cache hits",
    )
    v.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between those lines (default: %(default)s)",
    )
    v.add_argument(
        "--max-stored-responses",
        type=int,
        default=DEFAULT_MAX_STORED_RESPONSES,
        help="Responses API answers kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, the oldest dropped first; 0 keeps none (default: %(default)s)",
    )
    v.add_argument(
        "--responses-store-bytes",
        type=parse_bytes("--responses-store-bytes"),
        default=DEFAULT_RESPONSES_STORE_BYTES,
        help="and their estimated size in all (bytes, or with a unit: 64MiB, 1GiB), the "
        "oldest dropped first; a response larger than this alone is not stored "
        "(default: 256MiB)",
    )
    v.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse (400) a request body field no route declares, instead of ignoring it "
        "with a warning as vLLM does",
    )
    v.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: --tool-call-parser alone turns it on",
    )
    _add_http_flags(v)
    _add_limit_flags(v)
    _add_api_flags(v)
    _add_worker_flags(v)
    _add_engine_flags(v)


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    """The server's HTTP settings: its key, CORS and TLS, and the path a proxy serves it under."""
    p.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="every route but /health, /ping, /metrics, /version, /load, /openapi.json and "
        "/docs wants `Authorization: Bearer KEY` or `x-api-key: KEY` (default: "
        f"${envs.API_KEY}, which keeps the key out of the process list; unset: no key)",
    )
    p.add_argument(
        "--allowed-origins",
        type=string_list,
        help="answer browsers' cross-origin requests (CORS) from these origins: a comma-"
        'separated list or a JSON list (vLLM\'s form), "*" for any (default: none; vLLM '
        "allows any origin by default)",
    )
    p.add_argument("--allowed-methods", type=string_list, default=["*"], help="with CORS")
    p.add_argument("--allowed-headers", type=string_list, default=["*"], help="with CORS")
    p.add_argument("--allow-credentials", action="store_true", help="with CORS: allow credentials")
    p.add_argument("--ssl-keyfile", type=Path, help="serve HTTPS with this private key")
    p.add_argument("--ssl-certfile", type=Path, help="... and this certificate chain")
    p.add_argument(
        "--ssl-ca-certs", type=Path, help="CA certificates to check clients' certificates with"
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="clients' certificates: 0 not asked, 1 checked if sent, 2 required (mutual TLS)",
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves this server under (ASGI root_path)",
    )


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """How large a request and how slow or many its connections may be."""
    limits = ConnectionLimits()
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes("--max-request-body-bytes"),
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="a larger request body is answered 413 (default: %(default)s, 32MiB)",
    )
    p.add_argument(
        "--max-connections",
        type=positive("--max-connections"),
        default=limits.max_connections,
        help="open connections at most (fewer if the process's descriptor limit is lower); "
        "one more closes the one waiting longest for a request (default: %(default)s)",
    )
    for flag, default, what in (
        (
            "--timeout-request-head",
            limits.head_timeout_s,
            "whose request head is incomplete after this long",
        ),
        ("--timeout-request-body", limits.body_timeout_s, "whose request body pauses this long"),
        ("--timeout-keep-alive", 5.0, "idle this long after an answer (uvicorn's keep-alive)"),
    ):
        p.add_argument(
            flag,
            type=seconds(flag),
            default=default,
            metavar="SECONDS",
            help=f"close a connection {what} (default: %(default)s)",
        )


def _add_run_batch(sub: Any) -> None:
    """`pagedserve run-batch`: OpenAI's Batch API file format, offline."""
    b = sub.add_parser(
        "run-batch",
        help="OpenAI's Batch API file format, run offline (launch/openai/run_batch.py)",
    )
    b.add_argument("-i", "--input", required=True, type=Path, help="JSON lines of batch requests")
    b.add_argument("-o", "--output", required=True, type=Path, help="JSON lines (-: stdout)")
    b.add_argument("--no-progress", action="store_true", help="no progress lines")
    _add_api_flags(b)
    _add_worker_flags(b)
    _add_engine_flags(b)


def _add_worker(sub: Any) -> None:
    """`pagedserve worker`: one worker rank that connects to a core."""
    w = sub.add_parser("worker", help="run one worker rank that connects to a core")
    w.add_argument("--core", required=True, help="the core's worker address, tcp://HOST:PORT")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=positive("--tp"),
        default=EngineArgs.tensor_parallel_size,
    )
    w.add_argument("--dist-init", help="torch.distributed rendezvous (needed when --tp > 1)")
    w.add_argument(
        "--core-timeout",
        type=float,
        default=_WORKER_DEFAULTS["core_timeout_s"],
        help="seconds to wait for the core to answer before giving up",
    )
    _add_worker_flags(w)
    _add_log_level(w, "this worker")
    _add_keys_flag(
        w,
        "the core's worker address is tcp://: speak CURVE to it with this "
        "directory's client.key_secret and server.key",
    )


def _add_replay(sub: Any) -> None:
    """`pagedserve replay`: a recording replayed into fresh workers."""
    r = sub.add_parser(
        "replay",
        help="replay a recording (generate --record) into fresh workers and check that "
        "outputs and block tables equal it, bit for bit",
    )
    r.add_argument("dir", type=Path, metavar="DIR", help="the recording's directory")
    r.add_argument("--model", help="the checkpoint to load instead of the recorded path")
    r.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the workers to start, and for each step",
    )
    _add_log_level(r, "workers")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields the engine's flags set (generate, serve, run-batch)."""
    return dict(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_offload_memory=args.kv_offload_memory,
        kv_cache_dir=args.kv_cache_dir,
        kv_cache_dir_size=args.kv_cache_dir_size,
        kv_tier_load_bytes=args.kv_tier_load_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_tokens_per_request=args.prefill_tokens_per_request,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        hash_algo=args.hash,
        scheduling_policy=args.scheduling_policy,
        prefix_cache_hash_seed=args.prefix_cache_hash_seed_file or envs.prefix_cache_hash_seed(),
        zmq_curve_keys=args.zmq_curve_keys,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        generation_config=args.generation_config,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        log_kv=args.log_kv,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        **distributed_kwargs(args),
        startup_timeout_s=args.worker_timeout,
        step_timeout_s=args.step_timeout,
        record_dir=args.record,
    )
