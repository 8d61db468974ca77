"""Two workers on one host lend each other their CPUs while idle (`nori serve --cpu-lending`).

Why: a prefill and a decode worker on cores of their own (nori.launch.cpu_plan) never stall
each other's OpenMP teams, but when one has nothing to do its cores sit idle while the other
computes on half the machine. On the 2-core hosts a colocated worker decoded at 7 ms a token
where a disaggregated decode worker, on its one core, took 12, and computed a 1,500-token prompt
in 0.43 s where a prefill worker took 0.76: at low request rates colocated finished every run
sooner, though both met every SLO (docs/benchmarks.md, issue 28).

How: the two workers share a tiny file in shared memory with one 8-byte word per worker: 0
while it has work, else the moment (CLOCK_MONOTONIC, one clock for the host) it went idle.
Before each step a worker marks itself busy and reads its partner's word: partner idle for at
least `LEND_AFTER_IDLE_S`, the step runs on both workers' CPUs with a thread per CPU; otherwise on
its own CPUs with its own thread count. A worker going idle writes the time. The switch is the
engine loop's own: `torch.set_num_threads` on that thread (OpenMP's thread count is the calling
thread's) and the CPU affinity of every thread of the process (the OpenMP team inherits the
engine thread's).

Why the wait, and why measured: under a steady stream of short prompts a prefill worker is idle
for a few milliseconds at a time, and the gateway, which lives on its CPUs, streams every token.
A decode worker that took the prefill worker's core in every gap served the demo model at
concurrency 16 at 0.74x (`bench/ab_serve.sh`): its steps on both cores took 15-20 ms where its
own core took 4.4 (likely: the team member beside the busy gateway held up the other at every
barrier; not proven). Hence the partner must have been idle for `LEND_AFTER_IDLE_S`, and lent CPUs are used
only while the engine's step-cost fits (one per thread count, `LLMEngine.predicted_step_s`) say a
step like the last one is faster on them (`PAYS_OFF_BELOW`); one step in `REMEASURE_EVERY` that
would not pay uses them anyway, so the fit follows the load. With the small model decoding one
stream, the same decode worker took 5.6 ms a step on both cores against 9.3 on its own.

The cost when both get work at once: the partner that just started shares its cores with the
borrower's team until the borrower's current step ends (one step), after which the borrower
is back on its own cores. Only pairs: with three or more workers, two borrowers of one idle
worker would share its cores (the launcher lends only between one prefill and one decode
worker on disjoint CPUs).

The decision itself is pure (`cpus_for_step`); `CpuLending` holds the mapped file and applies it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nori.launch.cpu_plan import format_cpu_list, parse_cpu_list

logger = logging.getLogger(__name__)

# Slots in the shared file: one 8-byte word each, the workers of a lending pair.
LENDING_SLOTS = 2
_FILE_BYTES = 64
# A word's value while its worker has work (and before it ever started: a fresh file lends
# nothing); otherwise its worker's idle-since time in nanoseconds.
_BUSY = 0
# How long the partner must have been idle before its CPUs are used.
LEND_AFTER_IDLE_S = 0.1
# Lent CPUs are used only while steps on them are predicted to take at most this share of a
# step on the worker's own (measured by the engine's step-cost fits per thread count)...
PAYS_OFF_BELOW = 0.9
# ... and, where they do not, every this many steps anyway, to keep measuring them.
REMEASURE_EVERY = 200
# Seconds between the log lines stating what lent CPUs are measured to save.
_REPORT_EVERY_S = 60.0

# What a step like the last one would take on N threads (None: not measured yet).
StepPrediction = Callable[[int], float | None]


@dataclass(frozen=True)
class CpuLendingSpec:
    """`--cpu-lending FILE:SLOT:PARTNER_CPUS`: the shared file, this worker's slot in it (0 or
    1; the partner has the other), and the CPUs the partner lends while idle."""

    path: Path
    slot: int
    partner_cpus: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> CpuLendingSpec:
        path, _, rest = text.rpartition(":")
        path, _, slot_text = path.rpartition(":")
        if not path or not slot_text or not rest:
            raise ValueError(f"--cpu-lending {text!r}: expected FILE:SLOT:PARTNER_CPUS")
        if slot_text not in ("0", "1"):
            raise ValueError(f"--cpu-lending {text!r}: the slot is 0 or 1, got {slot_text!r}")
        return cls(Path(path), int(slot_text), parse_cpu_list(rest, "--cpu-lending"))

    def flag_value(self) -> str:
        return f"{self.path}:{self.slot}:{format_cpu_list(self.partner_cpus)}"

    @property
    def partner_slot(self) -> int:
        return 1 - self.slot


def cpus_for_step(
    own_cpus: frozenset[int],
    partner_cpus: frozenset[int],
    partner_idle_since_ns: int,
    now_ns: int,
    lend_after_idle_s: float = LEND_AFTER_IDLE_S,
) -> frozenset[int]:
    """The CPUs the next step runs on: the partner's too once it has been idle for
    `lend_after_idle_s` (`partner_idle_since_ns` is _BUSY while it has work)."""
    if partner_idle_since_ns == _BUSY or now_ns - partner_idle_since_ns < lend_after_idle_s * 1e9:
        return own_cpus
    return own_cpus | partner_cpus


class CpuLending:
    """One worker's side of a lending pair, used by its engine loop only (one thread)."""

    def __init__(self, spec: CpuLendingSpec, own_cpus: frozenset[int], own_threads: int) -> None:
        if own_cpus & spec.partner_cpus:
            raise ValueError(
                f"--cpu-lending: the partner's CPUs {format_cpu_list(spec.partner_cpus)} overlap "
                f"this worker's {format_cpu_list(own_cpus)}"
            )
        self.spec = spec
        self.own_cpus = own_cpus
        self.own_threads = own_threads
        fd = os.open(spec.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _FILE_BYTES:
                os.ftruncate(fd, _FILE_BYTES)
            self._file = mmap.mmap(fd, _FILE_BYTES)
        finally:
            os.close(fd)
        # Aligned 8-byte words: each is written and read in one access.
        self._words = memoryview(self._file).cast("q")
        self._words[spec.slot] = _now_ns()
        self._busy = False
        self._cpus = own_cpus
        # Steps run on the partner's CPUs too, since the start.
        self.num_borrowed_steps = 0
        # Steps that could have used lent CPUs and did not, as measured not to pay.
        self._num_declined = 0
        self._reported_at = time.monotonic()

    def close(self) -> None:
        """Lends nothing from now on (a worker that stops takes no more steps, and a new one in
        its place marks itself idle when it starts)."""
        with contextlib.suppress(ValueError, BufferError):
            self._words[self.spec.slot] = _BUSY
            self._words.release()
            self._file.close()

    @property
    def borrowing(self) -> bool:
        return self._cpus != self.own_cpus

    def before_step(self, predicted: StepPrediction | None = None) -> None:
        """Marks this worker busy and moves the coming step onto the CPUs it may use now:
        the idle partner's too, where `predicted` (the engine's `predicted_step_s`) says steps
        on them pay."""
        if not self._busy:
            self._words[self.spec.slot] = _BUSY
            self._busy = True
        partner = self._words[self.spec.partner_slot]
        cpus = cpus_for_step(self.own_cpus, self.spec.partner_cpus, partner, _now_ns())
        if cpus != self.own_cpus and predicted is not None and not self._pays(predicted, cpus):
            cpus = self.own_cpus
        self._move_to(cpus)
        self.num_borrowed_steps += self.borrowing

    def _pays(self, predicted: StepPrediction, cpus: frozenset[int]) -> bool:
        """Whether a step on `cpus` is measured to be enough faster than on the worker's own.
        Until steps on its own CPUs are measured, no; then until steps on lent CPUs are, yes;
        where they do not pay, every REMEASURE_EVERY-th step anyway."""
        lent_s, own_s = predicted(len(cpus)), predicted(self.own_threads)
        if time.monotonic() - self._reported_at >= _REPORT_EVERY_S:
            self._reported_at = time.monotonic()
            logger.info(
                "CPU lending: a step like the last takes %s on lent CPUs, %s on its own; %d steps "
                "on lent CPUs, %d declined",
                _ms(lent_s),
                _ms(own_s),
                self.num_borrowed_steps,
                self._num_declined,
            )
        if own_s is None:
            return False  # steps on its own CPUs first: the measure the others must beat
        if lent_s is None or lent_s <= PAYS_OFF_BELOW * own_s:
            return True
        self._num_declined += 1
        return self._num_declined % REMEASURE_EVERY == 0

    def idle(self) -> None:
        """Nothing to compute: the partner may use this worker's CPUs, and this worker goes back
        to its own (its next step starts there, whatever the partner is doing by then)."""
        if self._busy:
            self._words[self.spec.slot] = _now_ns()
            self._busy = False
        self._move_to(self.own_cpus)

    def _move_to(self, cpus: frozenset[int]) -> None:
        if cpus == self._cpus:
            return
        import torch

        threads = self.own_threads if cpus == self.own_cpus else len(cpus)
        # Widen before adding threads (the new ones inherit it); narrow after removing them.
        if len(cpus) > len(self._cpus):
            _set_process_affinity(cpus)
            torch.set_num_threads(threads)
        else:
            torch.set_num_threads(threads)
            _set_process_affinity(cpus)
        self._cpus = cpus


def _ms(seconds: float | None) -> str:
    return "(not measured)" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _now_ns() -> int:
    # Never _BUSY: CLOCK_MONOTONIC counts from boot.
    return max(time.monotonic_ns(), 1)


def _set_process_affinity(cpus: frozenset[int]) -> None:
    """Every thread of this process onto `cpus` (Linux affinity is per thread)."""
    os.sched_setaffinity(0, cpus)
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/task"):
            # A thread may have ended since it was listed.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(int(name), cpus)


def open_lending(spec: CpuLendingSpec | None) -> CpuLending | None:
    """This process's side of the pair, from its own CPUs and torch's thread count now; None
    without a spec, or (logged) where the file cannot be mapped."""
    if spec is None:
        return None
    import torch

    own_cpus = frozenset(os.sched_getaffinity(0))
    try:
        lending = CpuLending(spec, own_cpus, int(torch.get_num_threads()))
    except (OSError, ValueError) as error:
        logger.warning("CPU lending is off: %s", error)
        return None
    logger.info(
        "CPU lending: steps run on CPUs %s too while the partner worker is idle (slot %d of %s)",
        format_cpu_list(spec.partner_cpus),
        spec.slot,
        spec.path,
    )
    return lending
