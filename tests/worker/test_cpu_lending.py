"""CPU lending between two co-hosted workers: the flag's parsing and the decision (pure), and
one side of a pair in a process of its own, on a real shared file, moving its threads and its
CPU affinity as its partner's word says."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nori.worker.cpu_lending import CpuLendingSpec, cpus_for_step


def test_spec_parses_and_prints_back() -> None:
    spec = CpuLendingSpec.parse("/dev/shm/nori-x:1:0-1,4")
    assert spec == CpuLendingSpec(Path("/dev/shm/nori-x"), 1, frozenset({0, 1, 4}))
    assert spec.partner_slot == 0
    assert spec.flag_value() == "/dev/shm/nori-x:1:0-1,4"
    assert CpuLendingSpec.parse(spec.flag_value()) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/dev/shm/x:2:0", "the slot is 0 or 1"),
        ("/dev/shm/x:0", "expected FILE:SLOT:PARTNER_CPUS"),
        ("/dev/shm/x:0:", "expected FILE:SLOT:PARTNER_CPUS"),
        ("/dev/shm/x:0:a", "is not a CPU number"),
    ],
)
def test_bad_specs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CpuLendingSpec.parse(text)


def test_a_step_uses_the_partners_cpus_once_it_has_been_idle_a_while() -> None:
    own, partner = frozenset({2, 3}), frozenset({0, 1})
    second = 1_000_000_000
    busy = 0
    assert cpus_for_step(own, partner, busy, 100 * second) == own
    # Idle since 50 ms: it may get work again any moment.
    assert cpus_for_step(own, partner, 100 * second - second // 20, 100 * second) == own
    assert cpus_for_step(own, partner, 99 * second, 100 * second) == frozenset({0, 1, 2, 3})
    assert cpus_for_step(own, partner, 99 * second, 100 * second, lend_after_idle_s=2) == own


# One side of a pair, slot 1 on CPU 1, lent CPU 0: each line in is a command, each line out
# what the process runs on after it.
_SIDE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from nori.worker.cpu_lending import CpuLendingSpec, open_lending

    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    lending = open_lending(CpuLendingSpec.parse(sys.argv[1]))
    for command in sys.stdin:
        getattr(lending, command.strip())()
        torch.ones(64, 64) @ torch.ones(64, 64)  # a step's work, on the team it now has
        affinities = {
            sorted(os.sched_getaffinity(int(t))).__repr__() for t in os.listdir("/proc/self/task")
        }
        print(json.dumps({
            "threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "all_threads_cpus": sorted(affinities),
            "borrowed_steps": lending.num_borrowed_steps,
        }), flush=True)
    lending.close()
    """
)


@pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 (lent and own)"
)
def test_a_worker_borrows_its_idle_partners_cpu_and_gives_it_back(tmp_path: Path) -> None:
    flags_path = tmp_path / "lending"
    side = subprocess.Popen(
        [sys.executable, "-c", _SIDE, f"{flags_path}:1:0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert side.stdin is not None and side.stdout is not None

    def run(command: str) -> dict[str, object]:
        assert side.stdin is not None and side.stdout is not None
        side.stdin.write(command + "\n")
        side.stdin.flush()
        return dict(json.loads(side.stdout.readline()))

    try:
        # The partner's word (slot 0), as the partner process would write it: 0 busy, else
        # the time it went idle (1 ns after boot: long ago).
        partner_busy = run("idle")  # the side has mapped the file by its first answer
        with flags_path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as shared:
            flags = memoryview(shared).cast("q")
            assert partner_busy["cpus"] == [1] and partner_busy["threads"] == 1
            assert flags[0] == 0  # nobody in slot 0 yet: nothing to borrow
            assert run("before_step")["threads"] == 1
            flags[0] = time.monotonic_ns()  # idle only just now: not yet
            assert run("before_step")["cpus"] == [1]
            flags[0] = 0  # the partner is busy: the side steps on its own CPU
            busy = run("before_step")
            assert busy == {
                "threads": 1,
                "cpus": [1],
                "all_threads_cpus": ["[1]"],
                "borrowed_steps": 0,
            }
            assert flags[1] == 0  # it marked itself busy
            flags[0] = 1  # the partner went idle long ago: the next step runs on both CPUs
            lent = run("before_step")
            assert lent == {
                "threads": 2,
                "cpus": [0, 1],
                "all_threads_cpus": ["[0, 1]"],
                "borrowed_steps": 1,
            }
            flags[0] = 0  # the partner has work again: back on its own CPU, every thread
            back = run("before_step")
            assert back["threads"] == 1 and back["all_threads_cpus"] == ["[1]"]
            assert back["borrowed_steps"] == 1
            flags[0] = 1
            assert run("before_step")["threads"] == 2
            went_idle = time.monotonic_ns()
            idle = run("idle")  # idle: its own CPU again, and its idle time for the partner
            assert idle["threads"] == 1 and idle["all_threads_cpus"] == ["[1]"]
            assert went_idle <= flags[1] <= time.monotonic_ns()
            flags.release()
    finally:
        side.stdin.close()
        assert side.wait(30) == 0


def test_lent_cpus_are_used_only_where_steps_on_them_are_measured_faster(tmp_path: Path) -> None:
    from nori.worker.cpu_lending import PAYS_OFF_BELOW, REMEASURE_EVERY, CpuLending

    lending = CpuLending(CpuLendingSpec(tmp_path / "f", 1, frozenset({0})), frozenset({1}), 1)
    both = frozenset({0, 1})
    try:
        measured: dict[int, float | None] = {1: None, 2: None}
        # Its own CPUs first: the measure lent ones must beat.
        assert not lending._pays(measured.get, both)
        measured[1] = 0.010
        assert lending._pays(measured.get, both)  # lent ones not measured yet: measure them
        measured[2] = 0.010 * PAYS_OFF_BELOW
        assert lending._pays(measured.get, both)
        # Slower on lent CPUs (a busy gateway on them): declined, but measured again now and then.
        measured[2] = 0.030
        answers = [lending._pays(measured.get, both) for _ in range(2 * REMEASURE_EVERY)]
        assert answers.count(True) == 2 and answers[REMEASURE_EVERY - 1]
    finally:
        lending.close()
