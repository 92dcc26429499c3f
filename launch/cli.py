"""The `pagedserve` console script.

pagedserve generate [--model DIR] --input FILE.jsonl --output FILE.jsonl [flags]
pagedserve serve [--model DIR] [--host 127.0.0.1] [--port 8000] [flags]
pagedserve replay DIR [--model DIR]
pagedserve keys DIR [--client NAME ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from launch.cli_flags import build_parser, engine_kwargs
from launch.client.signals import Terminated, install_signal_handlers
from launch.input_lines import read_inputs
from protocol.gc_heap import freeze_startup_heap


def _start_command(args: argparse.Namespace) -> None:
    """Signals and logging of a command that runs an engine: SIGTERM and SIGHUP unwind like
    Ctrl-C (start-up and the run stop what they started)."""
    install_signal_handlers()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")


def _no_input(path: Path, command: str) -> bool:
    """Whether the input file is missing (said on stderr)."""
    if path.is_file():
        return False
    what = "is not a file" if path.exists() else "not found"
    print(f"pagedserve {command}: input file {what}: {path}", file=sys.stderr)
    return True


def generate(args: argparse.Namespace) -> int:
    from launch.client.engine_processes import EngineDeadError
    from launch.client.llm import LLM, CompletionOutput
    from launch.output_file import OutputWriteError
    from launch.results import ResultWriter

    _start_command(args)
    if _no_input(args.input, "generate"):
        return 2
    try:
        items = read_inputs(args.input, args)
        writer = ResultWriter(args.output)  # before the engine: a bad path fails at once
    except OSError as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 2
    good = [(i, n, it) for i, (n, it) in enumerate(items) if not isinstance(it, str)]
    # Per input line: how many results it asked for (n) and how many were written, so that
    # with n > 1 the summary counts prompts and completions apart.
    wanted = [1 if isinstance(it, str) else it.sampling_params.n for _, it in items]
    got = [1 if isinstance(it, str) else 0 for _, it in items]
    failed_lines: set[int] = {i for i, (_, it) in enumerate(items) if isinstance(it, str)}

    def save(out: CompletionOutput) -> None:
        i, line, prompt = good[out.index]
        if out.error is not None:
            out.error = f"{args.input}:{line}: {out.error}"
        writer.write(i, out, prompt.sampling_params)
        got[i] += 1
        if out.finish_reason == "error":
            failed_lines.add(i)

    llm = None
    code = 0
    output_failed = False
    try:
        llm = LLM(
            args.model,
            log_level=args.log_level,
            chat_template=args.chat_template,
            **_engine_kwargs(args),
        )
        writer.start()  # the engine is up: only now may an existing file go
        freeze_startup_heap()
        for i, (_, it) in enumerate(items):
            if isinstance(it, str):
                writer.write(i, CompletionOutput(i, [], finish_reason="error", error=it))
        llm.generate([it for _, _, it in good], use_tqdm=not args.no_progress, on_finish=save)
    except (ValueError, EngineDeadError, OutputWriteError) as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        code = 1
        # A failed write ends the run (the engine and its open requests close below):
        # answers that cannot be kept are not computed, and its one line is all that is said.
        output_failed = isinstance(e, OutputWriteError)
    except KeyboardInterrupt:
        code = 130
    except Terminated as e:
        code = 128 + e.signum
    finally:
        if llm is not None:
            llm.close()
        code = _close_output(writer, code)
    if output_failed:
        return code
    # A line that failed is answered even with fewer than n results: a prompt that cannot
    # run fails once, not once per copy.
    cut_short = sum(1 for i in range(len(items)) if got[i] < wanted[i] and i not in failed_lines)
    return _generate_ended(llm, writer, len(items), cut_short, any(w > 1 for w in wanted), code)


def _generate_ended(
    llm: Any, writer: Any, num_lines: int, cut_short: int, fanned: bool, code: int
) -> int:
    """What a generate run that was not stopped by its output says at the end; its exit code."""
    if code >= 128:
        _print_interrupted("generate", writer.output, cut_short, fanned)
        return code
    assert llm is not None or code
    if llm is not None:
        completions = writer.written if fanned else None
        _print_summary(llm.last_summary, num_lines, writer.failed, cut_short, completions)
        if llm.dead_reason is not None:
            print(f"pagedserve generate: {llm.dead_reason}", file=sys.stderr)
            code = 1
    return _report_failures(writer, num_lines, fanned, code)


def _close_output(writer: Any, code: int) -> int:
    """Close generate's output (in input order after a clean run); 1 if that failed."""
    from launch.output_file import OutputWriteError

    try:
        writer.close(sort=code == 0)
    except OutputWriteError as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return code or 1
    except KeyboardInterrupt:  # while sorting: every result is there, in finish order
        return 130
    except Terminated as e:
        return 128 + e.signum
    return code


def _print_interrupted(command: str, output: Any, cut_short: int, fanned: bool) -> None:
    """The one line a stopped run ends with: where its finished results are."""
    if not output.started:
        print(
            f"pagedserve {command}: interrupted before the engine was up; {output.name} "
            "was left as it was",
            file=sys.stderr,
        )
        return
    done = "completions" if fanned else "results"
    what = "prompts" if fanned else "requests"
    cut = f", {cut_short} {what} were cut short" if cut_short >= 0 else ""
    print(
        f"pagedserve {command}: interrupted; {output.held()} finished {done} are in "
        f"{output.name}{cut}",
        file=sys.stderr,
    )


def _report_failures(writer: Any, num_lines: int, fanned: bool, code: int) -> int:
    """The failed results' errors on stderr (the first few); the exit code, 1 if any."""
    for error in writer.errors:
        print(f"  {error}", file=sys.stderr)
    if writer.failed > len(writer.errors):
        print(f"  ... and {writer.failed - len(writer.errors)} more", file=sys.stderr)
    if writer.failed and not code:
        total = f"{writer.written} completions" if fanned else f"{num_lines} requests"
        print(f"pagedserve generate: {writer.failed} of {total} failed", file=sys.stderr)
        code = 1
    return code


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's flags; a command's own process (its API server) joins the front's
    cores when the CPU placement reserves them."""
    return {**engine_kwargs(args), "pin_launcher": True}


def serve(args: argparse.Namespace) -> int:
    from launch.openai.run_server import serve

    _start_command(args)
    return serve(args, _engine_kwargs(args))


def run_batch(args: argparse.Namespace) -> int:
    from launch.client.engine_processes import EngineDeadError
    from launch.openai.api_server import OpenAIServer
    from launch.openai.run_batch import run
    from launch.openai.run_server import open_engine, served_names
    from launch.output_file import JsonLinesOutput, OutputWriteError

    _start_command(args)
    if _no_input(args.input, "run-batch"):
        return 2
    try:
        output = JsonLinesOutput(args.output)  # a bad path fails before the engine starts
    except OSError as e:
        print(f"pagedserve run-batch: {e}", file=sys.stderr)
        return 2
    engine = None
    code = 0
    try:
        engine = open_engine(args, _engine_kwargs(args))
        names = served_names(args)
        api = OpenAIServer(
            engine,
            names[0],
            tool_call_parser=args.tool_call_parser,
            max_stored_responses=0,
            reasoning_parser=args.reasoning_parser,
            aliases=names[1:],
        )
        code = run(api, args.input, output, not args.no_progress)
    except (ValueError, EngineDeadError, OutputWriteError) as e:
        print(f"pagedserve run-batch: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except Terminated as e:
        code = 128 + e.signum
    finally:
        if engine is not None:
            engine.shutdown()
        output.close()
    if code >= 128:
        _print_interrupted("run-batch", output, -1, False)
    return code


def _print_summary(
    s: Any, requests: int, failed: int, cut_short: int, completions: int | None = None
) -> None:
    """completions: the output lines, when n > 1 made them more than the input lines;
    failures then count completions and cut_short counts prompts."""
    if completions is None:
        short = f", {cut_short} cut short" if cut_short else ""
        counts = f"requests: {requests} ({failed} failed{short})"
    else:
        short = f" ({cut_short} cut short)" if cut_short else ""
        counts = f"prompts: {requests}{short} | completions: {completions} ({failed} failed)"
    print(
        f"{counts} | prompt tokens: {s.prompt_tokens} | "
        f"output tokens: {s.output_tokens} in {s.seconds:.2f} s "
        f"({s.output_tokens_per_s:.1f} tok/s) | prefix-cache hit rate: "
        f"{s.prefix_cache_hit_rate:.1%} | preemptions: "
        f"{s.stats.num_preemptions if s.stats else 0}"
        + (f" | {s.stats.spec_decode.summary()}" if s.stats and s.stats.spec_decode else "")
        + _tier_summary(s),
        file=sys.stderr,
    )


def _tier_summary(s: Any) -> str:
    """The KV tier's part of the summary line (empty without a tier)."""
    t = s.stats.kv_tier if s.stats else None
    if t is None:
        return ""
    mib = t.block_bytes / (1 << 20)
    return (
        f" | KV tier: {t.hits}/{t.queries} tokens hit, {t.stored_blocks} blocks stored "
        f"({t.stored_blocks * mib:.1f} MiB), {t.loaded_blocks} loaded "
        f"({t.loaded_blocks * mib:.1f} MiB"
        + (f", {t.disk_loaded_blocks} from disk" if t.disk_loaded_blocks else "")
        + f") in {t.load_seconds:.3f} s"
        + (f", {t.failed_blocks} unreadable (recomputed)" if t.failed_blocks else "")
        + (f", {t.promoted_blocks} promoted to host memory" if t.promoted_blocks else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "generate":
        return generate(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "run-batch":
        return run_batch(args)
    if args.command == "worker":
        return worker(args)
    if args.command == "replay":
        return replay(args)
    if args.command == "keys":
        return keys(args)
    return 0


def worker(args: argparse.Namespace) -> int:
    from launch.client.engine_args import worker_config
    from worker.main import run

    if not 0 <= args.rank < args.tp:
        print(f"pagedserve worker: --rank {args.rank} is outside --tp {args.tp}", file=sys.stderr)
        return 2
    if args.tp > 1 and not args.dist_init:
        print("pagedserve worker: --dist-init is required when --tp > 1", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from launch.client.builtin_model import builtin_model_dir

        model = str(builtin_model_dir())
    else:
        from launch.client.hub import resolve_model

        try:
            model = resolve_model(model)
        except ValueError as e:
            print(f"pagedserve worker: {e}", file=sys.stderr)
            return 1
    return run(
        worker_config(
            args,
            model=model,
            rank=args.rank,
            world_size=args.tp,
            core_address=args.core,
            dist_init=args.dist_init,
            core_timeout_s=args.core_timeout,
            log_level=args.log_level,
        )
    )


def keys(args: argparse.Namespace) -> int:
    """A new CURVE keys directory: the server keypair and the client keypairs asked for."""
    from protocol.zmq_security import KeysError, make_keys

    try:
        written = make_keys(args.dir, args.client or ["client"])
    except (KeysError, OSError) as e:
        print(f"pagedserve keys: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def replay(args: argparse.Namespace) -> int:
    """0: bit-exact; 1: a difference (named); 2: the recording cannot be replayed."""
    from launch.replay import ReplayMismatch, replay

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    model = args.model
    try:
        if model is not None:
            from launch.client.hub import resolve_model

            model = resolve_model(model)
        summary = replay(args.dir, model, args.timeout, args.log_level)
    except ValueError as e:  # RecordingError, or a Hub id that does not resolve
        print(f"pagedserve replay: {e}", file=sys.stderr)
        return 2
    except ReplayMismatch as e:
        print(f"pagedserve replay: differs from the recording at {e}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
