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


def _start_side(script: str, flags_path: Path) -> subprocess.Popen[str]:
    """One side of a pair in a process of its own: slot 1 on CPU 1, lent CPU 0."""
    side = subprocess.Popen(
        [sys.executable, "-c", script, f"{flags_path}:1:0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert side.stdin is not None and side.stdout is not None
    return side


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
    side = _start_side(_SIDE, flags_path)

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
    try:
        measured: dict[int, float | None] = {1: None, 2: None}
        # Its own CPUs first: the measure lent ones must beat.
        assert not lending._pays(measured[1], measured[2])
        measured[1] = 0.010
        assert lending._pays(measured[1], measured[2])  # lent ones not measured yet: measure them
        measured[2] = 0.010 * PAYS_OFF_BELOW
        assert lending._pays(measured[1], measured[2])
        # Slower on lent CPUs (a busy gateway on them): declined, but measured again now and then.
        measured[2] = 0.030
        answers = [lending._pays(measured[1], measured[2]) for _ in range(2 * REMEASURE_EVERY)]
        assert answers.count(True) == 2 and answers[REMEASURE_EVERY - 1]
    finally:
        lending.close()


# One side of a pair (slot 1 on CPU 1, lent CPU 0) with an engine computing one prompt, whose
# predictions each command sets: a line in is {"call": ..., "own": s, "lent": s}, a line out what the side runs on after.
_SIDE_WITH_ENGINE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from nori.worker.cpu_lending import CpuLendingSpec, open_lending

    from nori.engine.outputs import ComingStep

    class Engine:
        predictions = {}

        def coming_step(self, threads):
            # One long prompt, beside `rows` decode rows.
            seconds_on = {count: self.predictions.get(count) for count in threads}
            return ComingStep(self.rows, 1500, 1, seconds_on)

    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    lending = open_lending(CpuLendingSpec.parse(sys.argv[1]))
    engine = Engine()
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        engine.predictions = {1: command.get("own"), 2: command.get("lent")}
        engine.rows = command.get("rows", 0)
        if command["call"] == "before_step":
            lending.before_step(engine)
        else:
            getattr(lending, command["call"])()
        print(json.dumps({
            "threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "turns": lending.num_turns,
            "parks": lending.num_parks,
        }), flush=True)
    lending.close()
    """
)


@pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 (lent and own)"
)
def test_busy_workers_take_turns_on_each_others_cpus_for_long_steps(tmp_path: Path) -> None:
    """A long prompt step that pays on both CPUs asks the busy partner for its CPU, where it
    saves its request more than the partner's requests lose, and runs once the partner parks;
    it asks again only after a step of the partner's; a worker whose partner asks parks until the
    partner's step is done."""
    from nori.worker.cpu_lending import (
        _ASKING,
        _IDLE_SINCE,
        _MAX_PARK_S,
        _PARKED,
        _REQUESTS,
        _STEPS,
        ASK_ABOVE_S,
    )

    flags_path = tmp_path / "lending"
    side = _start_side(_SIDE_WITH_ENGINE, flags_path)
    assert side.stdout.readline().strip() == "ready"  # the file is mapped

    def send(call: str, own: float | None = None, lent: float | None = None, rows: int = 0) -> None:
        assert side.stdin is not None
        command = {"call": call, "own": own, "lent": lent, "rows": rows}
        side.stdin.write(json.dumps(command) + "\n")
        side.stdin.flush()

    def answer() -> dict[str, object]:
        assert side.stdout is not None
        return dict(json.loads(side.stdout.readline()))

    long_step = 4 * ASK_ABOVE_S
    try:
        with flags_path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as shared:
            words = memoryview(shared).cast("q")
            words[_IDLE_SINCE + 0] = 0  # the partner (slot 0) is busy throughout
            # A short step, or a long one that does not pay on both: its own CPU, nothing asked.
            send("before_step", own=ASK_ABOVE_S / 2, lent=ASK_ABOVE_S / 4)
            assert answer()["cpus"] == [1]
            send("before_step", own=long_step, lent=long_step)
            assert answer()["cpus"] == [1]
            assert words[_ASKING + 1] == 0
            assert words[_REQUESTS + 1] == 1  # what its steps serve, for the partner to weigh
            # Twice as fast on both, but the partner serves 2 requests: a turn would save the
            # side's one request half the step and cost each of the partner's the other half.
            words[_REQUESTS + 0] = 2
            send("before_step", own=long_step, lent=long_step / 2)
            assert answer()["cpus"] == [1]
            # One request on the partner: the turn saves more than it costs. Not for a step
            # with decode rows (turns are for prompt steps)...
            words[_REQUESTS + 0] = 1
            send("before_step", own=long_step, lent=long_step / 2.5, rows=1)
            assert answer()["cpus"] == [1]
            assert words[_REQUESTS + 1] == 2
            # ... but for the prompt alone the side asks, and waits for the partner to park.
            send("before_step", own=long_step, lent=long_step / 2.5)
            deadline = time.monotonic() + 5
            while not words[_ASKING + 1]:
                assert time.monotonic() < deadline, "the side never asked"
                time.sleep(0.001)
            words[_PARKED + 0] = 1
            turn = answer()
            assert turn["cpus"] == [0, 1] and turn["threads"] == 2 and turn["turns"] == 1
            assert words[_ASKING + 1] != 0  # the partner stays parked while the step runs
            send("after_step")
            assert answer()["cpus"] == [0, 1]
            assert words[_ASKING + 1] == 0  # done: the partner may go on
            words[_PARKED + 0] = 0
            # The partner has taken no step since: no second turn yet, its own CPU again.
            send("before_step", own=long_step, lent=long_step / 2.5)
            again = answer()
            assert again["cpus"] == [1] and again["turns"] == 1
            assert words[_ASKING + 1] == 0
            # The partner asks for the side's CPU: the side parks before its next step...
            words[_STEPS + 0] += 1
            words[_ASKING + 0] = time.monotonic_ns()
            send("before_step", own=ASK_ABOVE_S / 2, lent=ASK_ABOVE_S)
            while not words[_PARKED + 1]:
                assert time.monotonic() < deadline, "the side never parked"
                time.sleep(0.001)
            steps_parked = words[_STEPS + 1]
            time.sleep(0.05)
            assert words[_STEPS + 1] == steps_parked  # no step while parked
            # ... and steps once the partner's step is done.
            words[_ASKING + 0] = 0
            parked = answer()
            assert parked["parks"] == 1 and parked["cpus"] == [1]
            assert words[_PARKED + 1] == 0 and words[_STEPS + 1] == steps_parked + 1
            # An ask its partner left behind (killed while asking) holds nothing up for long.
            words[_ASKING + 0] = time.monotonic_ns() - int((_MAX_PARK_S + 1) * 1e9)
            send("before_step", own=ASK_ABOVE_S / 2, lent=ASK_ABOVE_S)
            assert answer()["parks"] == 1
            words.release()
    finally:
        side.stdin.close()
        assert side.wait(30) == 0
