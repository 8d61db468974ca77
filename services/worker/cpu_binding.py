"""`nori serve --cpus LIST --threads N`: pin this process and size its thread pools, from inside.

Done in the process itself, so that a container (or anything else that runs `nori serve`) gets
the same binding as `nori up`. Linux CPU affinity belongs to each thread, and a new thread
inherits its creator's, so `bind_process` runs first thing in the role's handler, before gRPC's
pollers, asyncio's executor, the engine thread and the OpenMP pool start: they all inherit it.
The few threads that already exist by then (importing torch, which building the command's
parser does, starts one) are pinned one by one.

The intra-op thread count is set with `torch.set_num_threads` (`set_torch_threads`): torch is
already loaded when the handler runs, and OpenMP and MKL read OMP_NUM_THREADS/MKL_NUM_THREADS
only once, when they load. The launcher (`nori up`) therefore also puts those variables in the
child's environment, and `bind_process` sets them for whatever this process starts later.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from nori.launch.cpu_plan import format_cpu_list, parse_usable_cpus

logger = logging.getLogger(__name__)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class CpuBinding:
    # None: not pinned (every CPU the process was started with).
    cpus: frozenset[int] | None = None
    # None: the libraries' own default.
    threads: int | None = None

    @classmethod
    def from_flags(
        cls, cpus: str | None, threads: int | None, default_threads: int | None = None
    ) -> CpuBinding:
        """--cpus and --threads, checked. Without --threads, a pinned process runs
        `default_threads` threads, or one per CPU when that is None."""
        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        if cpus is None:
            return cls(None, threads)
        chosen = parse_usable_cpus(cpus, "--cpus", frozenset(os.sched_getaffinity(0)))
        assert chosen is not None
        return cls(chosen, threads or default_threads or len(chosen))


def bind_process(binding: CpuBinding) -> None:
    """Pins this process and sets the thread variables: first thing, so that the threads
    started later inherit the CPUs."""
    if binding.cpus is not None:
        # Pid 0 is the calling thread only; the others are pinned by their thread ids.
        os.sched_setaffinity(0, binding.cpus)
        for thread_id in _thread_ids():
            # A thread may have ended since it was listed.
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(thread_id, binding.cpus)
    if binding.threads is not None:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(binding.threads)


def _thread_ids() -> list[int]:
    """This process's threads (Linux: /proc/self/task); none where that is not there."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return []


def set_torch_threads(binding: CpuBinding) -> int:
    """Sets torch's intra-op threads (when the binding says how many); returns the count torch
    now uses."""
    import torch

    if binding.threads is not None:
        torch.set_num_threads(binding.threads)
    return int(torch.get_num_threads())


def log_binding(role: str, threads: int | None) -> None:
    """The CPUs this process may run on, read back from the kernel, and its thread count."""
    where = format_cpu_list(os.sched_getaffinity(0))
    logger.info("%s: CPUs %s, intra-op threads %s", role, where, threads or "default")
