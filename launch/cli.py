"""The `pagedserve` console script.

pagedserve generate [--model DIR] --input FILE.jsonl --output FILE.jsonl [flags]
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import msgspec

from protocol.engine import SamplingParams


class InputLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a generate input file; unset fields take the command-line defaults."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None


def _version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The flags both commands pass to their workers (named as WORKER_SETTINGS reads them)."""
    p.add_argument("--model", help="local Hugging Face model directory (default: built-in)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests)")
    p.add_argument("--block-size", type=_positive("--block-size"), default=16)
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--kv-cache-memory",
        type=_positive("--kv-cache-memory"),
        help="bytes of KV cache per worker (default: 256 MiB on CPU; on a GPU 90%% of its "
        "memory less the weights and a profiled step's peak)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive("--max-num-batched-tokens"),
        default=8192,
        help="tokens per step (a GPU worker profiles a step this large to size its KV cache)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_positive("--max-num-seqs"),
        default=256,
        help="requests per step",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="pagedserve: a CUDA-free EngineCore that owns the KV cache, plus workers.",
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser("generate", help="offline generation over a JSON-lines file")
    _add_worker_flags(g)
    g.add_argument("--input", required=True, type=Path, help="JSON lines: {'prompt': ...}")
    g.add_argument("--output", required=True, type=Path, help="JSON lines, in input order")
    g.add_argument("--max-tokens", type=_positive("--max-tokens"), default=16)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument(
        "--num-gpu-blocks",
        type=_positive("--num-gpu-blocks"),
        help="override the KV cache size in blocks (counts the null block)",
    )
    g.add_argument("--max-model-len", type=_positive("--max-model-len"))
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--hash", choices=("xxh3_128", "sha256"), default="xxh3_128")
    g.add_argument(
        "--tensor-parallel-size", "--tp", type=_positive("--tensor-parallel-size"), default=1
    )
    g.add_argument(
        "--external-workers",
        action="store_true",
        help="wait for N `pagedserve worker` processes instead of spawning them",
    )
    g.add_argument(
        "--worker-address",
        help="where the core listens for workers "
        "(tcp://HOST:PORT or ipc://PATH; port 0: the core picks free ports and logs "
        "the address; default: private ipc, or tcp://127.0.0.1:29550 with --external-workers)",
    )
    g.add_argument(
        "--dist-init",
        help="torch.distributed rendezvous for TP workers "
        "(tcp://HOST:PORT, or file://PATH on one machine; default: a file in the "
        "engine's private directory)",
    )
    g.add_argument(
        "--worker-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for every worker to report at start-up",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--log-level", default="WARNING", help="engine processes' log level")

    w = sub.add_parser("worker", help="run one worker rank that connects to a core")
    w.add_argument("--core", required=True, help="the core's worker address, tcp://HOST:PORT")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_positive("--tp"), default=1)
    w.add_argument("--dist-init", help="torch.distributed rendezvous (needed when --tp > 1)")
    _add_worker_flags(w)
    return parser


def _read_inputs(path: Path, args: argparse.Namespace) -> list:  # list[Prompt | str]
    """Parse every line; a bad line becomes an error string and fails alone."""
    from launch.llm import Prompt

    if not path.exists():
        raise SystemExit(f"pagedserve generate: input file not found: {path}")
    decoder = msgspec.json.Decoder(InputLine)
    items: list = []
    for n, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = decoder.decode(raw)
            params = SamplingParams(
                max_tokens=_pick(line.max_tokens, args.max_tokens),
                temperature=_pick(line.temperature, args.temperature),
                top_p=_pick(line.top_p, args.top_p),
                top_k=_pick(line.top_k, args.top_k),
                seed=line.seed,
                stop_token_ids=line.stop_token_ids or [],
                ignore_eos=bool(line.ignore_eos),
            )
            params.validate()
            items.append(Prompt(line.prompt, line.prompt_token_ids, params, line.cache_salt))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            items.append(f"{path}:{n}: {e}")
    return items


def _pick(value, default):
    return default if value is None else value


def generate(args: argparse.Namespace) -> int:
    from launch.engine import EngineDeadError
    from launch.llm import LLM, CompletionOutput

    items = _read_inputs(args.input, args)
    try:
        llm = LLM(
            args.model,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory=args.kv_cache_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            hash_algo=args.hash,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
            external_workers=args.external_workers,
            worker_address=args.worker_address,
            dist_init=args.dist_init,
            startup_timeout_s=args.worker_timeout,
            log_level=args.log_level,
        )
    except (ValueError, EngineDeadError) as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagedserve generate: interrupted", file=sys.stderr)
        return 130
    try:
        good = [(i, it) for i, it in enumerate(items) if not isinstance(it, str)]
        outs = llm.generate([it for _, it in good], use_tqdm=not args.no_progress)
    except EngineDeadError as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagedserve generate: interrupted", file=sys.stderr)
        return 130
    finally:
        llm.close()
    results: list[CompletionOutput] = []
    by_index = {i: o for (i, _), o in zip(good, outs)}
    for i, it in enumerate(items):
        if isinstance(it, str):
            results.append(CompletionOutput(i, [], finish_reason="error", error=it))
        else:
            out = by_index[i]
            out.index = i
            results.append(out)
    _write_outputs(args.output, results)
    s = llm.last_summary
    failed = sum(1 for r in results if r.finish_reason == "error")
    print(
        f"requests: {len(results)} ({failed} failed) | prompt tokens: {s.prompt_tokens} | "
        f"output tokens: {s.output_tokens} in {s.seconds:.2f} s "
        f"({s.output_tokens_per_s:.1f} tok/s) | prefix-cache hit rate: "
        f"{s.prefix_cache_hit_rate:.1%} | preemptions: "
        f"{s.stats.num_preemptions if s.stats else 0}",
        file=sys.stderr,
    )
    for r in results:
        if r.error:
            print(f"  request {r.index} failed: {r.error}", file=sys.stderr)
    if llm.dead_reason is not None:
        print(f"pagedserve generate: {llm.dead_reason}", file=sys.stderr)
        return 1
    return 0


def _write_outputs(path: Path, results: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in results:
            line = {
                "index": r.index,
                "prompt_token_ids": r.prompt_token_ids,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "num_cached_tokens": r.num_cached_tokens,
            }
            if r.text is not None:
                line["text"] = r.text
            if r.error is not None:
                line["error"] = r.error
            f.write(msgspec.json.encode(line) + b"\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "generate":
        return generate(args)
    if args.command == "worker":
        return worker(args)
    return 0


def worker(args: argparse.Namespace) -> int:
    from launch.engine import worker_config
    from worker.main import run

    if not 0 <= args.rank < args.tp:
        print(f"pagedserve worker: --rank {args.rank} is outside --tp {args.tp}", file=sys.stderr)
        return 2
    if args.tp > 1 and not args.dist_init:
        print("pagedserve worker: --dist-init is required when --tp > 1", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from launch.builtin_model import builtin_model_dir

        model = str(builtin_model_dir())
    return run(
        worker_config(
            args,
            model=model,
            rank=args.rank,
            world_size=args.tp,
            core_address=args.core,
            dist_init=args.dist_init,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
