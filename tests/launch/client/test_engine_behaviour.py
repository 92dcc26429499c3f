"""Engine behaviour through the real processes: stop conditions, aborts, seeds, idling."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from launch import LLM, Prompt, SamplingParams
from launch.client.builtin_model import builtin_model_dir
from launch.client.engine_args import EngineArgs
from launch.client.engine_processes import EngineDeadError, EngineProcesses
from tests.helpers.cli_helpers import CPU

os.environ["PAGEDSERVE_CHECK_INVARIANTS"] = "1"  # the core checks KV invariants every step
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16]


def test_stop_token_ids_and_eos_stop_generation(llama_dir: Path, tmp_path: Path) -> None:
    with LLM(str(llama_dir), device=CPU) as llm:
        (full,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
        stop_at = full.token_ids[3]
        first = full.token_ids.index(stop_at)
        params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at])
        (stopped,) = llm.generate([PROMPT], params, use_tqdm=False)
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == full.token_ids[: first + 1]
        assert llm.last_summary.stats is not None
        assert llm.last_summary.stats.kv_cache_usage == 0.0  # every block back in the pool
    # The same token as the model's EOS: stops unless ignore_eos.
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    for f in llama_dir.iterdir():
        (eos_dir / f.name).write_bytes(f.read_bytes())
    config = json.loads((llama_dir / "config.json").read_text())
    config["eos_token_id"] = stop_at
    (eos_dir / "config.json").write_text(json.dumps(config))
    with LLM(str(eos_dir), device=CPU) as llm:
        stops = SamplingParams(max_tokens=12, temperature=0)
        (eos_stop,) = llm.generate([PROMPT], stops, use_tqdm=False)
        (ignored,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert eos_stop.finish_reason == "stop"
    assert eos_stop.token_ids == full.token_ids[: first + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == full.token_ids


def test_seeded_sampling_ignores_batch_neighbours(llama_dir: Path) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    other = SamplingParams(max_tokens=10, temperature=1.0)
    with LLM(str(llama_dir), device=CPU) as llm:
        (alone,) = llm.generate([PROMPT], seeded, use_tqdm=False)
        mixed = llm.generate(
            [
                Prompt(prompt_token_ids=[3, 4, 5], sampling_params=other),
                Prompt(prompt_token_ids=PROMPT, sampling_params=seeded),
                Prompt(prompt_token_ids=[9] * 9, sampling_params=other),
            ],
            use_tqdm=False,
        )
        assert mixed[1].token_ids == alone.token_ids


def test_abort_frees_blocks_and_others_finish() -> None:
    # The built-in model (4096 positions): "a" could run for minutes, so however slowly
    # this process reads, the abort reaches it mid-run.
    with EngineProcesses(EngineArgs(model=str(builtin_model_dir()), device=CPU)) as engine:
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=4000, ignore_eos=True))
        engine.add_request("b", PROMPT[:4], SamplingParams(max_tokens=20, ignore_eos=True))
        seen: dict[str, list[int]] = {"a": [], "b": []}
        reasons: dict[str, str] = {}
        aborted = False
        stats = None
        deadline = time.monotonic() + 600  # only so that a broken engine cannot hang CI
        while len(reasons) < 2 and time.monotonic() < deadline:
            batch = engine.get_outputs()
            if batch is None:
                continue
            stats = batch.stats or stats
            for o in batch.outputs:
                seen[o.request_id].extend(o.new_token_ids)
                if o.finish_reason:
                    reasons[o.request_id] = o.finish_reason
            if not aborted and len(seen["a"]) >= 5:
                engine.abort(["a", "no-such-request"])
                aborted = True
        assert reasons == {"a": "abort", "b": "length"}
        assert 5 <= len(seen["a"]) < 4000 and len(seen["b"]) == 20
        assert stats is not None and stats.kv_cache_usage == 0.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_engine_does_not_spin(llama_dir: Path) -> None:
    with EngineProcesses(EngineArgs(model=str(llama_dir), device=CPU)) as engine:
        time.sleep(0.5)
        pids = [p.pid for p in engine.procs.values()]
        before = [_cpu_seconds(p) for p in pids]
        time.sleep(3)
        used = [_cpu_seconds(p) - b for p, b in zip(pids, before)]
        assert all(u < 0.3 for u in used), used


def test_a_pool_too_small_for_an_explicit_max_model_len_refuses_to_start(
    llama_dir: Path,
) -> None:
    # 8 blocks of 4 tokens, 7 usable: 28 tokens, while the model allows 256.
    with pytest.raises(EngineDeadError) as info:
        LLM(str(llama_dir), device=CPU, num_gpu_blocks=8, block_size=4, max_model_len=256)
    message = str(info.value)
    assert "the KV cache holds 7 blocks, but one request of max_model_len 256" in message
    assert "needs 64" in message and "--max-model-len" in message
    assert "(at most 28 fits)" in message


def test_without_max_model_len_a_small_pool_serves_the_longest_request_it_holds(
    llama_dir: Path,
) -> None:
    # The same pool: the length fits itself to the 28 tokens the pool holds.
    with LLM(str(llama_dir), device=CPU, num_gpu_blocks=8, block_size=4) as llm:
        assert llm.max_model_len == 28
        (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
        assert out.finish_reason == "length" and len(out.token_ids) == 12
