"""Record and replay: a recording of the frames the core sent its workers replays into fresh
workers, with no core, and reproduces their outputs and block tables bit for bit; a
recording that was tampered with, or made by another version, is named as such.

Every recording here comes from real engine processes; every replay starts real workers."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from launch.client.builtin_model import builtin_model_dir
from launch.client.engine_args import EngineArgs
from launch.client.engine_processes import EngineProcesses
from launch.replay import ReplayMismatch, replay
from launch.replay_tables import CoreBlockTables
from protocol.codec import Codec
from protocol.engine import SamplingParams
from protocol.recording import (
    FRAMES,
    MANIFEST,
    OUTPUT,
    STEP,
    Recorder,
    Recording,
    RecordingError,
)
from protocol.worker import (
    PROTOCOL_VERSION,
    CoreToWorker,
    ModelRunnerOutput,
    SchedulerOutput,
    TierStep,
    WorkerToCore,
)
from tests.helpers.cli_helpers import CPU, ENV, generate_cli
from tests.helpers.hf_checkpoints import VOCAB, save_checkpoint

TO_WORKER: Codec[CoreToWorker] = Codec(CoreToWorker, "test core->worker")
TO_CORE: Codec[WorkerToCore] = Codec(WorkerToCore, "test worker->core")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    """n prompts of 6 to 33 tokens; every other one extends a shared 13-token prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(13)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 21))]
        out.append(prefix + tail if i % 2 else tail)
    return out


@dataclass
class Workload:
    """Waves of requests; a wave starts once the one before it finished. abort: request
    id -> abort it once it sampled this many tokens."""

    waves: list[list[tuple[str, list[int], SamplingParams]]]
    abort: dict[str, int] = field(default_factory=dict)


def mixed(ps: list[list[int]], wave: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy, random and seeded requests: all three must replay to the same tokens."""
    kinds = (GREEDY, SAMPLED, SEEDED)
    return [(f"w{wave}r{i}", p, kinds[i % 3]) for i, p in enumerate(ps)]


def record(args: EngineArgs, work: Workload) -> None:
    abort = dict(work.abort)
    with EngineProcesses(args) as engine:
        for wave in work.waves:
            open_ids = set()
            for rid, prompt, params in wave:
                engine.add_request(rid, prompt, params)
                open_ids.add(rid)
            seen = {rid: 0 for rid in open_ids}
            deadline = time.monotonic() + 300  # only so that a broken engine cannot hang CI
            while open_ids and time.monotonic() < deadline:
                batch = engine.get_outputs()
                for o in batch.outputs if batch else ():
                    seen[o.request_id] += len(o.new_token_ids)
                    if o.finish_reason:
                        assert o.finish_reason != "error", o.error
                        open_ids.discard(o.request_id)
                    elif seen[o.request_id] >= abort.get(o.request_id, 1 << 30):
                        engine.abort([o.request_id])
                        del abort[o.request_id]
            assert not open_ids, f"requests {open_ids} did not finish"


def steps(rec: Path) -> list[SchedulerOutput]:
    out = []
    for kind, payload in Recording(rec).records():
        if kind == STEP:
            so = TO_WORKER.decode(payload)
            assert isinstance(so, SchedulerOutput)
            out.append(so)
    return out


# -- what each scenario's recording must show happened ---------------------------------


def has_prefix_hit(sos: list[SchedulerOutput]) -> bool:
    return any(r.num_computed_tokens > 0 for so in sos for r in so.new_reqs)


def has_chunked_prefill(sos: list[SchedulerOutput]) -> bool:
    return any(
        n < len(r.prompt_token_ids) - r.num_computed_tokens
        for so in sos
        for r, n in zip(so.new_reqs, so.num_scheduled_tokens)
    )


def has_preemption_and_resume(sos: list[SchedulerOutput]) -> bool:
    return any(so.preempted_req_ids for so in sos) and any(
        any(so.cached_reqs.resumed) for so in sos
    )


def has_sliding_window_frees(sos: list[SchedulerOutput]) -> bool:
    return any(any(s) for so in sos for s in so.cached_reqs.num_skipped_blocks if s)


def has_abort_mid_run(sos: list[SchedulerOutput]) -> bool:
    """ "long" (4000 tokens asked) leaves while "short" still runs."""
    for so in sos:
        if "long" in so.finished_req_ids:
            return "short" in so.cached_reqs.req_ids
    return False


def has_prefix_hit_on_2_ranks(sos: list[SchedulerOutput]) -> bool:
    return has_prefix_hit(sos)  # the manifest's world size is checked below


def has_tier_loads(sos: list[SchedulerOutput]) -> bool:
    return any(isinstance(so, TierStep) and so.kv_tier.load_block_ids for so in sos)


def has_load_only_step(sos: list[SchedulerOutput]) -> bool:
    """A two-phase disk load: a step of loads and no tokens, answered all the same."""
    return any(
        isinstance(so, TierStep)
        and so.kv_tier.disk_load_block_ids
        and not so.total_num_scheduled_tokens
        for so in sos
    )


def evict_and_reload() -> Workload:
    """A 40-token document, another that evicts it from a 15-block pool, then the first
    again: it comes back from the KV tier (its answer reports the load's time)."""
    rng = random.Random(9)
    a, b = ([rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(2))
    return Workload([mixed([[*a, 1]]), mixed([[*b, 1]], wave=1), mixed([[*a, 2]], wave=2)])


@dataclass
class Scenario:
    model: str  # "llama", "qwen2_interleaved" or "builtin"
    args: dict
    work: Callable[[], Workload]
    covers: Callable[[list[SchedulerOutput]], bool]
    world_size: int = 1


def two_waves() -> Workload:
    ps = prompts(8)
    return Workload([mixed(ps[1:2]), mixed([*ps[2:], ps[1][:12]], wave=1)])


SCENARIOS = {
    "prefix-hits": Scenario("llama", {}, two_waves, has_prefix_hit),
    "chunked-prefill": Scenario(
        "llama",
        {"max_num_batched_tokens": 7},
        lambda: Workload([mixed(prompts(6))]),
        has_chunked_prefill,
    ),
    # 19 usable blocks of 4 tokens for 14 requests of up to 41 tokens.
    "preemption": Scenario(
        "llama",
        {
            "num_gpu_blocks": 20,
            "max_num_seqs": 12,
            "max_model_len": 48,
            "max_num_batched_tokens": 16,
        },
        lambda: Workload([mixed(prompts(14))]),
        has_preemption_and_resume,
    ),
    # Window 6 over blocks of 4: prompts of 6-33 tokens free leading blocks as they run.
    "sliding-window": Scenario(
        "qwen2_interleaved",
        {"max_num_batched_tokens": 16},
        lambda: Workload([mixed(prompts(6))]),
        has_sliding_window_frees,
    ),
    # The built-in model's 4096 positions: "long" is aborted long before it could finish.
    "abort": Scenario(
        "builtin",
        {},
        lambda: Workload(
            [
                [
                    ("long", prompts(1)[0], SamplingParams(max_tokens=4000, ignore_eos=True)),
                    ("short", prompts(2)[1], SamplingParams(max_tokens=30, ignore_eos=True)),
                ]
            ],
            abort={"long": 5},
        ),
        has_abort_mid_run,
    ),
    "tp2": Scenario("llama", {}, two_waves, has_prefix_hit_on_2_ranks, world_size=2),
    "kv-tier": Scenario(
        "llama",
        {"num_gpu_blocks": 16, "kv_offload_memory": 1 << 20},
        evict_and_reload,
        has_tier_loads,
    ),
    "kv-disk-tier": Scenario(
        "llama",
        {"num_gpu_blocks": 16, "kv_cache_dir": "TMP"},
        evict_and_reload,
        has_load_only_step,
    ),
}


@pytest.fixture(scope="module")
def models(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    interleaved = tmp_path_factory.mktemp("qwen2_interleaved")
    save_checkpoint("qwen2_interleaved", interleaved)
    return {"llama": llama_dir, "qwen2_interleaved": interleaved, "builtin": builtin_model_dir()}


@pytest.fixture(scope="module")
def recordings(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Path]]:
    """Records a scenario on first use; later tests reuse the recording."""
    made: dict[str, Path] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CHECK_INVARIANTS", "1")  # the core checks KV rules each step

        def get(name: str) -> Path:
            if name not in made:
                s = SCENARIOS[name]
                rec = tmp_path_factory.mktemp("rec") / name
                extra = dict(s.args)
                if extra.get("kv_cache_dir") == "TMP":  # one per recording
                    extra["kv_cache_dir"] = str(tmp_path_factory.mktemp("kv"))
                args = EngineArgs(
                    model=str(models[s.model]),
                    device=CPU,
                    block_size=4,
                    tensor_parallel_size=s.world_size,
                    record_dir=str(rec),
                    **extra,
                )
                record(args, s.work())
                made[name] = rec
            return made[name]

        yield get


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_recording_replays_bit_exact(recordings, name: str) -> None:
    rec = recordings(name)
    manifest = Recording(rec).manifest
    assert manifest.complete and manifest.world_size == SCENARIOS[name].world_size
    sos = steps(rec)
    assert SCENARIOS[name].covers(sos), f"the {name} recording does not show it happening"
    summary = replay(rec, timeout_s=120)
    assert summary.steps == len(sos) == manifest.records["step"]
    assert summary.requests == len({r.req_id for so in sos for r in so.new_reqs})
    assert summary.sampled_tokens > 0 and not summary.truncated


def test_generate_record_then_replay_on_the_command_line(llama_dir: Path, tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    lines = [
        json.dumps({"prompt_token_ids": p, "max_tokens": 6, "ignore_eos": True}) for p in prompts(4)
    ]
    gen, results = generate_cli(llama_dir, lines, tmp_path, "--record", str(rec))
    assert gen.returncode == 0, gen.stderr
    assert [len(r["token_ids"]) for r in results] == [6] * 4
    proc = replay_cli(rec)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("replay ok: ")
    assert "4 requests" in proc.stdout and "24 sampled" in proc.stdout
    again, _ = generate_cli(llama_dir, lines, tmp_path, "--record", str(rec))
    assert again.returncode == 1 and "already holds a recording" in again.stderr


def replay_cli(rec: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "launch.cli", "replay", str(rec), "--timeout", "120", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, check=False)


# -- tampered and foreign recordings ------------------------------------------------------


def rewrite(src: Path, dst: Path, edit: Callable[[int, int, bytes], bytes]) -> None:
    """A copy of a recording whose record i of kind k holds edit(i, k, payload)."""
    recording = Recording(src)
    recorder = Recorder(dst, recording.manifest.worker)
    for i, (kind, payload) in enumerate(recording.records()):
        recorder.write(kind, edit(i, kind, payload))
    recorder.close()


def test_a_flipped_block_id_fails_replay_at_its_step(recordings, tmp_path: Path) -> None:
    # The first new request that gets a fresh block while another request holds one is
    # handed that other request's block instead.
    src = recordings("preemption")
    tables = CoreBlockTables([4])
    target: tuple[int, str, int, str] | None = None  # (record index, request, block, holder)
    records = list(Recording(src).records())
    for i, (kind, payload) in enumerate(records):
        if kind != STEP:
            continue
        so = TO_WORKER.decode(payload)
        assert isinstance(so, SchedulerOutput)
        gone = set(so.finished_req_ids) | set(so.preempted_req_ids)
        holders = {r: t for r, t in tables.tables.items() if r not in gone and t[0]}
        fresh = [r for r in so.new_reqs if len(r.block_ids[0]) > r.num_computed_tokens // 4]
        if holders and fresh:
            holder, table = next(iter(holders.items()))
            target = (i, fresh[0].req_id, table[0][-1], holder)
            break
        tables.apply(so)
    assert target is not None
    index, victim, block, holder = target

    def flip(i: int, kind: int, payload: bytes) -> bytes:
        if i != index:
            return payload
        so = TO_WORKER.decode(payload)
        assert isinstance(so, SchedulerOutput)
        new = so.new_reqs[[r.req_id for r in so.new_reqs].index(victim)]
        ids = list(new.block_ids[0])
        ids[-1] = block
        flipped = msgspec.structs.replace(new, block_ids=[ids])
        reqs = [flipped if r is new else r for r in so.new_reqs]
        return TO_WORKER.encode(msgspec.structs.replace(so, new_reqs=reqs))

    rewrite(src, tmp_path / "flipped", flip)
    step_id = TO_WORKER.decode(records[index][1]).step_id  # type: ignore[union-attr]
    proc = replay_cli(tmp_path / "flipped")
    assert proc.returncode == 1, proc.stderr
    assert f"step {step_id}, request {victim!r}" in proc.stderr
    assert f"block {block} as new while request {holder!r} still holds it" in proc.stderr


def test_a_changed_output_token_names_step_request_and_both_values(
    recordings, tmp_path: Path
) -> None:
    src = recordings("prefix-hits")
    outputs = [i for i, (k, _) in enumerate(Recording(src).records()) if k == OUTPUT]
    index = outputs[len(outputs) // 2]
    changed: list[ModelRunnerOutput] = []

    def change(i: int, kind: int, payload: bytes) -> bytes:
        if i != index:
            return payload
        out = TO_CORE.decode(payload)
        assert isinstance(out, ModelRunnerOutput)
        tokens = list(out.sampled_token_ids)
        tokens[-1] = (tokens[-1] + 1) % VOCAB
        changed.append(out)
        return TO_CORE.encode(msgspec.structs.replace(out, sampled_token_ids=tokens))

    rewrite(src, tmp_path / "changed", change)
    (out,) = changed
    was, now = out.sampled_token_ids[-1], (out.sampled_token_ids[-1] + 1) % VOCAB
    with pytest.raises(ReplayMismatch) as err:
        replay(tmp_path / "changed", timeout_s=120)
    assert str(err.value) == (
        f"step {out.step_id}, request {out.req_ids[-1]!r}: the worker sampled token {was}, "
        f"the recording has {now}"
    )


@pytest.mark.parametrize("field_name", ["protocol_version", "format_version"])
def test_a_recording_of_an_older_version_is_refused_by_name(
    recordings, tmp_path: Path, field_name: str
) -> None:
    old = tmp_path / "old"
    shutil.copytree(recordings("prefix-hits"), old)
    manifest = json.loads((old / MANIFEST).read_text())
    theirs = manifest[field_name] - 1
    manifest[field_name] = theirs
    (old / MANIFEST).write_text(json.dumps(manifest))
    proc = replay_cli(old)
    assert proc.returncode == 2
    what = "protocol" if field_name == "protocol_version" else "format"
    assert f"{what} {theirs}" in proc.stderr, proc.stderr
    ours = PROTOCOL_VERSION if what == "protocol" else manifest[field_name] + 1
    assert f"{what} {ours}" in proc.stderr, proc.stderr


def test_a_recording_whose_worker_settings_lack_one_is_refused_naming_it(
    recordings, tmp_path: Path
) -> None:
    # As format 1 recordings made before WorkerConfig carried log_level are: no default
    # stands in for a setting, so the one missing is named (exit 2: cannot be replayed).
    old = tmp_path / "old"
    shutil.copytree(recordings("prefix-hits"), old)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["worker"]["log_level"]
    (old / MANIFEST).write_text(json.dumps(manifest))
    proc = replay_cli(old)
    assert proc.returncode == 2
    assert "missing required field `log_level` - at `$.worker`" in proc.stderr, proc.stderr


def test_a_crashed_run_replays_up_to_its_last_whole_record(recordings, tmp_path: Path) -> None:
    crashed = tmp_path / "crashed"
    shutil.copytree(recordings("prefix-hits"), crashed)
    manifest = json.loads((crashed / MANIFEST).read_text())
    manifest["complete"] = False  # as a recorder killed before its close leaves it
    (crashed / MANIFEST).write_text(json.dumps(manifest))
    frames = (crashed / FRAMES).read_bytes()
    (crashed / FRAMES).write_bytes(frames[:-3])  # the last record torn in the middle
    whole = list(Recording(crashed).records())
    assert len(whole) == sum(manifest["records"].values()) - 1
    summary = replay(crashed, timeout_s=120)
    assert summary.truncated
    assert summary.steps == sum(1 for k, _ in whole if k == STEP)


def test_a_damaged_closed_recording_is_refused(recordings, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(recordings("prefix-hits"), damaged)
    frames = bytearray((damaged / FRAMES).read_bytes())
    frames[len(frames) // 2] ^= 0xFF
    (damaged / FRAMES).write_bytes(bytes(frames))
    with pytest.raises(RecordingError, match="is damaged at byte"):
        list(Recording(damaged).records())
