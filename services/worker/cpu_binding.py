"""`nori serve --cpus LIST --threads N`: pin this process and size its thread pools, from inside.

Done in the process itself, so a container gets the same binding as `nori up`. CPU affinity is
per thread and inherited, so `bind_process` runs first thing in the role's handler, before
gRPC's pollers, asyncio's executor, the engine thread and the OpenMP pool start; the few threads
already there (importing torch starts one) are pinned one by one. Without flags, a process whose
CFS quota is below its affinity (a container given `cpus:`) runs one thread per whole CPU of its
quota (`usable_cpu_count`). torch is already loaded by then, so the intra-op thread count is set
with `torch.set_num_threads`; OpenMP and MKL read OMP_NUM_THREADS/MKL_NUM_THREADS only when they
load, so `nori up` also puts them in the child's environment, and `bind_process` sets them for
whatever this process starts later.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

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
        `default_threads` threads, or one per CPU when that is None; an unpinned one under a CPU
        quota smaller than its affinity runs one per whole CPU of the quota."""
        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        if cpus is None:
            usable = usable_cpu_count()
            if threads is None and usable < len(os.sched_getaffinity(0)):
                threads = usable
            return cls(None, threads)
        chosen = parse_usable_cpus(cpus, "--cpus", frozenset(os.sched_getaffinity(0)))
        assert chosen is not None
        return cls(chosen, threads or default_threads or len(chosen))


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), own: str | None = None) -> float | None:
    """The CPUs this process's cgroup may use per period: cgroup v2 `cpu.max`, else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`. Read in the process's own cgroup (`own`: the text
    of /proc/self/cgroup), else at the hierarchy's root, which is where a container sees its own
    cgroup. None: no quota."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            own = ""
    paths = {
        controller: path.lstrip("/")
        for _, controllers, path in (line.split(":", 2) for line in own.splitlines() if line)
        for controller in controllers.split(",")
    }
    for folder in (root / paths.get("", ""), root):
        try:
            quota, period = (folder / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            continue
    for controller in ("cpu", "cpu,cpuacct"):
        for folder in (root / controller / paths.get("cpu", ""), root / controller):
            try:
                quota_us = int((folder / "cpu.cfs_quota_us").read_text())
                period_us = int((folder / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cpu_count(quota: float | None = None) -> int:
    """The CPUs this process can keep busy: its affinity, capped by whole CPUs of its quota
    (`cpu_quota()` when not given), at least 1."""
    count = len(os.sched_getaffinity(0))
    quota = cpu_quota() if quota is None else quota
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return count


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
