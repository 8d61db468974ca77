"""`nori serve --cpus LIST --threads N`: pin this process and size its thread pools, from inside
(so a container gets the same binding as `nori up`).

`bind_process` runs first in the role's handler (affinity is inherited); threads already there
are pinned one by one. Without flags, a process whose CFS quota is below its affinity runs one
thread per whole CPU of its quota. OMP/MKL variables are set for what starts later."""

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
    cpus: frozenset[int] | None = None  # None: not pinned
    threads: int | None = None  # None: the libraries' default

    @classmethod
    def from_flags(
        cls, cpus: str | None, threads: int | None, default_threads: int | None = None
    ) -> CpuBinding:
        """--cpus and --threads, checked. Without --threads: `default_threads`, else one per CPU
        (pinned), or one per whole CPU of a quota smaller than the affinity."""
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
    """The CPUs this process's cgroup may use per period (cgroup v2 `cpu.max`, else v1 cfs
    files) in its own cgroup (`own`: /proc/self/cgroup's text), else the root; None: no quota."""
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
    """Pins this process and sets the thread variables (first thing: later threads inherit)."""
    if binding.cpus is not None:
        # Pid 0 is the calling thread only; the others are pinned by their thread ids.
        os.sched_setaffinity(0, binding.cpus)
        for thread_id in _thread_ids():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(thread_id, binding.cpus)
    if binding.threads is not None:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(binding.threads)


def _thread_ids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return []


def set_torch_threads(binding: CpuBinding) -> int:
    """Sets torch's intra-op threads if the binding says; returns torch's count."""
    import torch

    if binding.threads is not None:
        torch.set_num_threads(binding.threads)
    return int(torch.get_num_threads())


def log_binding(role: str, threads: int | None) -> None:
    """The CPUs this process may run on, read back from the kernel, and its thread count."""
    where = format_cpu_list(os.sched_getaffinity(0))
    logger.info("%s: CPUs %s, intra-op threads %s", role, where, threads or "default")
