"""Two workers on one host lend each other their CPUs while idle (`nori serve --cpu-lending`).

Why: a prefill and a decode worker on cores of their own (nori.launch.cpu_plan) never stall
each other's OpenMP teams, but when one has nothing to do its cores sit idle while the other
computes on half the machine. On the 2-core hosts a colocated worker decoded at 7 ms a token
where a disaggregated decode worker, on its one core, took 12, and computed a 1,500-token prompt
in 0.43 s where a prefill worker took 0.76: at low request rates colocated finished every run
sooner, though both met every SLO (docs/benchmarks.md, issue 28).

How: the two workers share a tiny file in shared memory with a few 8-byte words per worker; the
first is 0 while it has work, else the moment (CLOCK_MONOTONIC, one clock for the host) it went
idle.
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
barrier; not proven). Hence the partner must have been idle for `LEND_AFTER_IDLE_S`, and lent CPUs are used only
while the engine's step-cost fits (one per thread count, `LLMEngine.coming_step`) say
the coming step is faster on them (`PAYS_OFF_BELOW`); one step in `REMEASURE_EVERY` that
would not pay uses them anyway, so the fit follows the load. With the small model decoding one
stream, the same decode worker took 5.6 ms a step on both cores against 9.3 on its own.

Turns, while both have work: a worker whose coming step computes prompts alone and would take
at least `ASK_ABOVE_S` on its own CPUs (a long prompt on a prefill worker's one core) and is measured to pay on both asks
its busy partner for its CPUs, where the turn saves its own requests more than it costs the
partner's, each of which waits for the whole turn (in request-seconds, as conditional
disaggregation weighs its paths): a prompt twice as fast on both CPUs is worth a turn beside one
stream, not beside two. The partner finishes the step it is in, then waits between steps
("parks") while the asker computes that one step on both workers' CPUs; the asker then asks
again only after the partner has had at least as long as that turn took (the partner keeps at
least half of its CPUs' time). On the 2-core hosts a 1,500-token prompt took a prefill worker
1.4 s on its one core and a colocated worker 0.7 s, enough to miss a 2 s time-to-first-token SLO
at 2 req/s when two met in the prefill worker's queue. Turns are whole steps: cut into chunks of
about 100 or 300 tokens (so the partner would wait less), the prompt computed on both cores at
0.6-1.1 ms a token, no faster than whole on one. That was before chunks attended through torch's
flash path (nori.kernels.prefill_attention_cpu; 300-token chunks now take 0.65 s of a
1,500-token prompt on both cores, 0.57 s whole); chunked turns have not been measured since. A
partner that gets work while a worker steps
on its CPUs parks too. Only pairs: with three or more workers, two borrowers of one idle worker
would share its cores (the launcher lends only between one prefill and one decode worker on
disjoint CPUs).

The decision itself is pure (`cpus_for_step`); `CpuLending` holds the mapped file and applies it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nori.launch.cpu_plan import format_cpu_list, parse_cpu_list

if TYPE_CHECKING:
    from nori.engine.outputs import ComingStep

logger = logging.getLogger(__name__)

# Slots in the shared file: the workers of a lending pair. The file holds 8-byte words, each
# worker's at one of these offsets plus its slot.
LENDING_SLOTS = 2
_FILE_BYTES = 128
# 0 (_BUSY) while its worker has work (and before it ever started: a fresh file lends nothing);
# otherwise the moment its worker went idle, in nanoseconds.
_IDLE_SINCE = 0
# While its worker steps on its partner's CPUs, or waits to, the moment it asked (nanoseconds;
# else 0): the partner parks meanwhile, but not for an ask older than _MAX_PARK_S (its worker
# was killed before it could clear it).
_ASKING = 2
# 1 while its worker waits between two steps for its partner's step on its CPUs to end.
_PARKED = 4
# Steps its worker has begun: an asker waits for one of its partner's between two turns.
_STEPS = 6
# The requests its worker's coming step serves (decode rows and prompts; 0 while idle).
_REQUESTS = 8
_BUSY = 0
# How long the partner must have been idle before its CPUs are used without asking.
LEND_AFTER_IDLE_S = 0.1
# Lent CPUs are used only while steps on them are predicted to take at most this share of a
# step on the worker's own (measured by the engine's step-cost fits per thread count)...
PAYS_OFF_BELOW = 0.9
# ... and, where they do not, every this many steps anyway, to keep measuring them.
REMEASURE_EVERY = 200
# A busy partner is asked for its CPUs only for a step this long on the worker's own.
ASK_ABOVE_S = 0.1
# How long an asker waits for its busy partner to take a step and park; the longest a worker
# parks for one ask (its partner stuck, or killed while asking).
_ASK_WAIT_S = 0.2
_MAX_PARK_S = 3.0
_POLL_S = 0.0002
# Seconds between the log lines stating what lent CPUs are measured to save.
_REPORT_EVERY_S = 60.0


class LendingEngine(Protocol):
    """What lending needs of the engine (nori.engine.engine.LLMEngine)."""

    def coming_step(self, threads: Sequence[int]) -> ComingStep: ...


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
        self._own = spec.slot
        self._partner = spec.partner_slot
        for offset in (_ASKING, _PARKED, _REQUESTS):
            self._words[offset + self._own] = 0
        self._words[_IDLE_SINCE + self._own] = _now_ns()
        self._busy = False
        self._cpus = own_cpus
        # Steps run on the partner's CPUs too, since the start; of those, while it was busy.
        self.num_borrowed_steps = 0
        self.num_turns = 0
        # Times this worker parked for its partner's step.
        self.num_parks = 0
        # Steps that could have used lent CPUs and did not, as measured not to pay.
        self._num_declined = 0
        # The partner's step count when this worker's last turn on its CPUs ended.
        self._partner_steps_at_turn = -1
        self._turn_started_at = self._turn_ended_at = -math.inf
        self._turn_s = 0.0
        self._reported_at = time.monotonic()

    def close(self) -> None:
        """Lends nothing from now on (a worker that stops takes no more steps, and a new one in
        its place marks itself idle when it starts)."""
        with contextlib.suppress(ValueError, BufferError):
            for offset in (_ASKING, _PARKED, _REQUESTS, _IDLE_SINCE):
                self._words[offset + self._own] = 0
            self._words.release()
            self._file.close()

    @property
    def borrowing(self) -> bool:
        return self._cpus != self.own_cpus

    def before_step(self, engine: LendingEngine | None = None) -> None:
        """Marks this worker busy, parks while the partner computes a turn on its CPUs, and
        moves the coming step onto the CPUs it may use now: the partner's too where `engine`'s
        step-cost fits say steps on them pay, and the partner has been idle a while or parks
        for a turn (without `engine`: whenever the partner has been idle a while)."""
        self.after_step()
        words = self._words
        if not self._busy:
            words[_IDLE_SINCE + self._own] = _BUSY
            self._busy = True
        self._park_while_partner_asks()
        words[_STEPS + self._own] += 1
        both = self.own_cpus | self.spec.partner_cpus
        partner_idle_long = (
            cpus_for_step(
                self.own_cpus, self.spec.partner_cpus, words[_IDLE_SINCE + self._partner], _now_ns()
            )
            == both
        )
        if engine is None:
            use_lent = partner_idle_long
        else:
            coming = engine.coming_step((self.own_threads, len(both)))
            own_s, lent_s = coming.seconds_on[self.own_threads], coming.seconds_on[len(both)]
            words[_REQUESTS + self._own] = coming.num_decode_rows + coming.num_prompts
            if not self._pays(own_s, lent_s):
                use_lent = False
            elif partner_idle_long:
                use_lent = True
            else:
                # Turns are for prompt steps (a decode worker asking would stop every prompt of
                # a busy prefill worker for its streams' steps: at 8 req/s of the mixed load it
                # served 0.24 of always-disaggregated's effective throughput).
                use_lent = (
                    coming.num_decode_rows == 0
                    and self._turn_pays(own_s, lent_s, coming.num_prompts)
                    and self._partner_parks()
                )
                self.num_turns += use_lent
        if use_lent:
            # A partner that gets work parks until this step ends (after_step).
            if not words[_ASKING + self._own]:
                words[_ASKING + self._own] = _now_ns()
            self._turn_started_at = time.monotonic()
        cpus = both if use_lent else self.own_cpus
        self._move_to(cpus)
        self.num_borrowed_steps += self.borrowing

    def after_step(self) -> None:
        """The step is done: a partner parked for it may go on."""
        words = self._words
        if words[_ASKING + self._own]:
            words[_ASKING + self._own] = 0
            self._partner_steps_at_turn = words[_STEPS + self._partner]
            now = time.monotonic()
            self._turn_s = now - self._turn_started_at
            self._turn_ended_at = now

    def _partner_asks(self) -> bool:
        asked_at = self._words[_ASKING + self._partner]
        return asked_at != 0 and _now_ns() - asked_at < _MAX_PARK_S * 1e9

    def _park_while_partner_asks(self) -> None:
        if not self._partner_asks():
            return
        self._move_to(self.own_cpus)
        self._words[_PARKED + self._own] = 1
        self.num_parks += 1
        while self._partner_asks():
            time.sleep(_POLL_S)
        self._words[_PARKED + self._own] = 0

    def _turn_pays(self, own_s: float | None, lent_s: float | None, num_requests: int) -> bool:
        """Whether to ask the busy partner for a turn: a step long enough on this worker's own
        CPUs (`ASK_ABOVE_S`), what the turn saves this worker's requests more than what it
        costs the partner's, each of which waits for the whole turn (in request-seconds, the
        measure conditional disaggregation weighs paths by), and the partner has had at least
        as long as this worker's last turn took since. own_s, lent_s: the coming step on its own
        CPUs and on both, by the engine's fits (None: not measured yet)."""
        if own_s is None or lent_s is None or own_s < ASK_ABOVE_S:
            return False
        if time.monotonic() - self._turn_ended_at < self._turn_s:
            return False
        partner_requests = self._words[_REQUESTS + self._partner]
        return (own_s - lent_s) * max(num_requests, 1) > lent_s * partner_requests

    def _partner_parks(self) -> bool:
        """Asks the busy partner for its CPUs for one step: True once it is parked (or idle),
        after a step of its own since this worker's last turn; False where it does not come to
        that soon, or asks for this worker's at the same time (slot 0 goes first)."""
        words = self._words
        deadline = time.monotonic() + _ASK_WAIT_S

        def partner_busy() -> bool:
            return words[_IDLE_SINCE + self._partner] == _BUSY

        while words[_STEPS + self._partner] == self._partner_steps_at_turn and partner_busy():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        words[_ASKING + self._own] = _now_ns()
        while partner_busy() and not words[_PARKED + self._partner]:
            both_ask = self._partner_asks() and self._own == 1
            if both_ask or time.monotonic() >= deadline:
                words[_ASKING + self._own] = 0
                return False
            time.sleep(_POLL_S)
        return True

    def _pays(self, own_s: float | None, lent_s: float | None) -> bool:
        """Whether the coming step is measured to be enough faster on both workers' CPUs
        (`lent_s`) than on this worker's own (`own_s`). Until steps on its own CPUs are measured,
        no; then until steps on lent CPUs are, yes; where they do not pay, every
        REMEASURE_EVERY-th step anyway."""
        if time.monotonic() - self._reported_at >= _REPORT_EVERY_S:
            self._reported_at = time.monotonic()
            logger.info(
                "CPU lending: the coming step takes %s on lent CPUs, %s on its own; %d steps "
                "on lent CPUs (%d of them turns it asked for), %d declined, "
                "parked %d times for the partner",
                _ms(lent_s),
                _ms(own_s),
                self.num_borrowed_steps,
                self.num_turns,
                self._num_declined,
                self.num_parks,
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
        self.after_step()
        if self._busy:
            self._words[_REQUESTS + self._own] = 0
            self._words[_IDLE_SINCE + self._own] = _now_ns()
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
