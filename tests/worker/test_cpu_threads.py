"""The CPU worker's thread tuner, driven with step times it is told (a simple model of a
machine on which one count is faster): it finds the faster count, stays put when the
other is slower, backs off its probes, and never compares steps of different sizes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from worker import cpu_threads
from worker.cpu_threads import CpuThreadTuner


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run(tuner: CpuThreadTuner, step_s: dict[int, float], steps: int, tokens: int = 64) -> list[int]:
    """Steps of one size; each takes what the machine model says for the count in use.
    Returns the thread count every step ran on."""
    used = []
    for _ in range(steps):
        tuner.before_step(tokens)
        used.append(torch.get_num_threads())
        tuner.after_step(step_s[torch.get_num_threads()])
    return used


def test_switches_to_the_faster_count_and_stays() -> None:
    tuner = CpuThreadTuner(1, 2)
    used = run(tuner, {1: 0.150, 2: 0.100}, 200)
    assert used[0] == 1
    assert tuner.threads == 2 and tuner.switches == 1
    # After the switch only probes run on one thread: two steps each (long steps), backing
    # off.
    assert used.count(1) < cpu_threads.FIRST_PROBE_AFTER + 2 * 4
    assert used[-1] == 2


def test_keeps_the_safe_count_when_the_other_is_slower_and_backs_off() -> None:
    tuner = CpuThreadTuner(1, 2)
    used = run(tuner, {1: 0.170, 2: 0.450}, 1000)
    assert tuner.threads == 1 and tuner.switches == 0
    probes = sum(1 for a, b in zip([1, *used], used) if a == 1 and b == 2)
    # Periods 4, then 128, 512, ..., capped: a handful of probes in 1000 steps, not 1000 / 4.
    assert 3 <= probes <= 10
    # Each losing probe costs its slow steps: two, for steps this long.
    assert used.count(2) == probes * cpu_threads.MIN_PROBE_STEPS


def test_after_a_switch_under_one_step_in_a_hundred_runs_on_the_slower_count() -> None:
    # A probe's steps are late tokens to every stream: a server's inter-token latency p99
    # must not be one of them, even in the thousands of steps right after a switch.
    tuner = CpuThreadTuner(1, 2)
    run(tuner, {1: 0.070, 2: 0.045}, 8)  # a decode step of one stream
    assert tuner.threads == 2
    for steps in (1000, 2000, 8000):
        used = run(tuner, {1: 0.070, 2: 0.045}, steps, tokens=1)
        assert used.count(1) < steps / 100, steps


@pytest.mark.parametrize("start", [1, 2])
def test_from_start_up_under_one_step_in_a_hundred_runs_on_the_slower_count(start: int) -> None:
    # A server's first thousand steps too: the start-up check, then rare probes.
    tuner = CpuThreadTuner(1, 2)
    tuner.threads = start
    step_s = {start: 0.045, 3 - start: 0.070}
    for steps in (1000, 2000, 8000):
        used = run(tuner, step_s, steps, tokens=1)
        assert tuner.threads == start
        assert used.count(3 - start) < steps / 100, steps


def test_a_small_gain_is_not_a_switch() -> None:
    tuner = CpuThreadTuner(1, 2)
    run(tuner, {1: 0.100, 2: 0.095}, 300)  # 5% faster: within the margin
    assert tuner.threads == 1


def test_switches_back_when_the_machine_gets_busy() -> None:
    tuner = CpuThreadTuner(1, 2)
    run(tuner, {1: 0.150, 2: 0.100}, 100)
    assert tuner.threads == 2
    run(tuner, {1: 0.170, 2: 0.450}, 200)  # another process now spins on a core
    assert tuner.threads == 1 and tuner.switches == 2


def test_a_count_whose_steps_scatter_loses_on_its_mean() -> None:
    """Two threads beside a busy server: a fast step among slow ones (mean 14 ms against a
    steady 11.7 on one thread). The fastest step would pick two threads; the mean keeps
    one, and leaves two when started there."""

    def scattered(count: int, i: int) -> float:
        return 0.0117 if count == 1 else (0.008, 0.020)[i % 2]

    for start in (1, 2):
        tuner = CpuThreadTuner(1, 2)
        tuner.threads = start
        for i in range(600):
            tuner.before_step(64)
            tuner.after_step(scattered(torch.get_num_threads(), i))
        assert tuner.threads == 1, f"started on {start}"


def test_a_short_steps_first_step_after_a_switch_is_not_timed() -> None:
    """A step on a count the last steps did not run on pays for the switch (10 -> 15 ms
    here); steady, two threads are 15% faster, and win."""
    tuner = CpuThreadTuner(1, 2)
    last = 1
    used = []
    for _ in range(100):
        tuner.before_step(64)
        count = torch.get_num_threads()
        used.append(count)
        tuner.after_step(0.015 if count != last else (0.010 if count == 1 else 0.0085))
        last = count
    assert tuner.threads == 2
    # The first probe: one untimed step, then 40 ms worth of timed ones (4 of 10 ms).
    first = used.index(2)
    assert used[first : first + 5] == [2] * 5


def test_long_steps_are_probed_two_at_a_time() -> None:
    """SmolLM2's ~130 ms steps, one thread slower (180 ms): a probe costs two steps."""
    tuner = CpuThreadTuner(1, 2)
    tuner.threads = 2
    used = run(tuner, {1: 0.180, 2: 0.130}, 300)
    assert tuner.threads == 2
    runs = "".join(map(str, used)).split("2")
    assert {len(r) for r in runs if r} == {cpu_threads.MIN_PROBE_STEPS}


def test_short_steps_and_changing_batches_are_never_probed() -> None:
    tuner = CpuThreadTuner(1, 2)
    assert run(tuner, {1: 0.001, 2: 0.0001}, 200) == [1] * 200  # too short to matter
    used = []
    for i in range(200):  # every step a different decode size: nothing to compare
        tuner.before_step(64 + i % 128)
        used.append(torch.get_num_threads())
        tuner.after_step(0.150 if used[-1] == 1 else 0.050)
    assert used == [1] * 200


def test_a_batch_change_mid_probe_restores_the_chosen_count() -> None:
    tuner = CpuThreadTuner(1, 2)
    run(tuner, {1: 0.150, 2: 0.100}, cpu_threads.FIRST_PROBE_AFTER)
    tuner.before_step(64)
    assert torch.get_num_threads() == 2  # probing
    tuner.after_step(0.1)
    tuner.before_step(65)  # the batch changed: the probe is void
    assert torch.get_num_threads() == 1 and tuner.threads == 1


def test_only_a_lone_cpu_worker_without_omp_num_threads_tunes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    tuner = CpuThreadTuner.for_worker(cpu, 1)
    assert tuner is not None and (tuner.low, tuner.high) == (1, 2)
    assert CpuThreadTuner.for_worker(cpu, 2) is None  # tensor-parallel ranks
    assert CpuThreadTuner.for_worker(torch.device("meta"), 1) is None
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    assert CpuThreadTuner.for_worker(cpu, 1) is None  # one core: nothing to choose
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert CpuThreadTuner.for_worker(cpu, 1) is None


def test_calibration_starts_on_one_of_the_two_counts() -> None:
    # Which one depends on the machine's load at that moment; that it is applied does not.
    tuner = CpuThreadTuner(1, 2)
    tuner.calibrate(reps=1)
    assert tuner.threads in (1, 2)
    assert torch.get_num_threads() == tuner.threads


def test_short_steps_run_on_the_low_count_even_when_every_core_won() -> None:
    tuner = CpuThreadTuner(1, 2)
    run(tuner, {1: 0.150, 2: 0.100}, 50)
    assert tuner.threads == 2
    # Tiny steps (a small model's decode): one thread, whatever won for long steps.
    assert run(tuner, {1: 0.0015, 2: 0.0021}, 50)[1:] == [1] * 49
    # Long again (twice the threshold on one thread): back to every core.
    used = run(tuner, {1: 0.150, 2: 0.100}, 10, tokens=128)
    assert used[0] == 1 and used[1:] == [2] * 9
    assert tuner.threads == 2


def test_prefills_get_their_own_count_compared_per_token() -> None:
    """Prefill-sized steps of changing sizes, two threads faster per token, interleaved
    with decode steps on which one thread is faster (a server's mix): each kind ends on
    its own count."""
    tuner = CpuThreadTuner(1, 2)
    per_token = {1: 20e-6, 2: 13e-6}  # prefill, as measured behind the server
    decode_s = {1: 0.0075, 2: 0.011}
    large_used = []
    for i in range(400):
        size = cpu_threads.LARGE_STEP_TOKENS + (i * 37) % 700
        tuner.before_step(size, 8)  # 8 requests, some of them prefilling
        large_used.append(torch.get_num_threads())
        tuner.after_step(size * per_token[torch.get_num_threads()])
        for _ in range(4):
            tuner.before_step(64)
            tuner.after_step(decode_s[torch.get_num_threads()])
    assert tuner.large_threads == 2 and tuner.threads == 1
    assert large_used[-50:].count(2) > 40  # only probes leave it


def test_prefills_stay_on_the_low_count_when_it_is_faster() -> None:
    tuner = CpuThreadTuner(1, 2)
    for i in range(300):
        size = 300 + (i * 53) % 500
        tuner.before_step(size, 4)
        tuner.after_step(size * (10e-6 if torch.get_num_threads() == 1 else 30e-6))
    assert tuner.large_threads == 1 and tuner.switches == 0


def test_a_large_decode_batch_is_a_decode_step() -> None:
    """256 requests decoding are 256 tokens: compared at equal counts, and short ones run
    on the low count unprobed, whatever prefills chose."""
    tuner = CpuThreadTuner(1, 2)
    for i in range(200):
        size = 300 + (i * 53) % 500
        tuner.before_step(size, 4)
        tuner.after_step(size * (30e-6 if torch.get_num_threads() == 1 else 10e-6))
    assert tuner.large_threads == 2
    used = []
    for _ in range(200):
        tuner.before_step(256, 256)
        used.append(torch.get_num_threads())
        tuner.after_step(0.0004 if used[-1] == 1 else 0.0006)
    assert used[1:] == [1] * 199 and tuner.threads == 1
