"""A worker's thread count follows the CPU quota it is given (a container's `cpus:`), not the
host's CPUs: cgroup files read from fake trees, then a real process in a real cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nori.worker.cpu_binding import cpu_quota, usable_cpu_count


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_read_from_the_process_own_cgroup(tmp_path: Path) -> None:
    _write(tmp_path / "cpu.max", "max 100000\n")
    _write(tmp_path / "pods" / "a" / "cpu.max", "150000 100000\n")
    assert cpu_quota(tmp_path, own="0::/pods/a\n") == 1.5
    # A container's own cgroup is the root it sees.
    assert cpu_quota(tmp_path, own="0::/\n") is None
    _write(tmp_path / "cpu.max", "50000 100000\n")
    assert cpu_quota(tmp_path, own="0::/docker/abc\n") == 0.5


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    own = "4:memory:/x\n1:cpu,cpuacct:/docker/abc\n"
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(tmp_path, own=own) is None
    _write(tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "200000\n")
    _write(tmp_path / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(tmp_path, own=own) == 2.0
    assert cpu_quota(tmp_path / "nothing", own=own) is None


def test_usable_cpus_are_whole_cpus_of_the_quota_within_the_affinity() -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpu_count(quota=1000.0) == affinity
    assert usable_cpu_count(quota=1.7) == 1
    assert usable_cpu_count(quota=0.2) == 1


CHILD = """
from nori.cli.main import build_parser
from nori.worker.cpu_binding import CpuBinding, usable_cpu_count
args = build_parser().parse_args(["serve", "decode"])
print(usable_cpu_count(), CpuBinding.from_flags(args.cpus, args.threads).threads)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to cap below")
def test_a_worker_in_a_one_cpu_cgroup_runs_one_thread() -> None:
    """A real cgroup (v1 `cpu` or v2) with a quota of one CPU, a real `nori serve` parser."""
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    name = f"nori-test-{uuid.uuid4().hex[:8]}"
    folder = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / name
    try:
        folder.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a cgroup here: {error}")
    try:
        if v1.is_dir():
            (folder / "cpu.cfs_quota_us").write_text("100000")
        elif v2.exists():
            (folder / "cpu.max").write_text("100000 100000")
        # The child moves itself in before Python starts.
        script = f"echo $$ > {folder}/cgroup.procs && exec {sys.executable} -c '{CHILD}'"
        out = subprocess.run(
            ["sh", "-c", script], capture_output=True, text=True, timeout=120, check=True
        )
        assert out.stdout.split() == ["1", "1"], out.stderr
        # Outside it, the same parse leaves the libraries' default.
        here = subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True
        )
        assert here.stdout.split() == [str(len(os.sched_getaffinity(0))), "None"], here.stderr
    finally:
        folder.rmdir()
