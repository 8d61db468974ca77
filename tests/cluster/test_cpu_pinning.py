"""Each role of a real cluster runs where its CPU plan says: every thread of the process (gRPC,
the engine thread, OpenMP's pool) on the planned CPUs, torch with the planned thread count."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from nori.launch.cpu_plan import CpuRequest, format_cpu_list, parse_cpu_list, plan_cpus
from nori.models.init_checkpoint import init_checkpoint
from tests.cluster.conftest import start_cluster

pytestmark = pytest.mark.slow


def thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    """Every thread of the process -> the CPUs it may run on (/proc/PID/task/TID/status)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        match = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.MULTILINE)
        assert match is not None
        found[int(task.name)] = parse_cpu_list(match.group(1))
    return found


def children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def test_every_process_runs_on_its_planned_cpus_and_threads(redis_url: str, tmp_path: Path) -> None:
    checkpoint = init_checkpoint(tmp_path / "tiny", "tiny", seed=5)
    # On this 2-core machine: prefill and gateway `--cpus 0 --threads 1`, decode `--cpus 1
    # --threads 1`; elsewhere whatever the default plan gives.
    plan = plan_cpus(os.sched_getaffinity(0), CpuRequest())
    cluster = start_cluster(redis_url, checkpoint, tmp_path / "logs", num_decode=1, cpu_plan=plan)
    try:
        response = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        for process in cluster.processes:
            placement = plan.placement(process.name, process.role)
            pid = process.process.pid
            assert os.sched_getaffinity(pid) == placement.cpus, process.name
            threads = thread_affinities(pid)
            assert len(threads) > 1, "gRPC and the engine run threads of their own"
            for tid, cpus in threads.items():
                assert cpus == placement.cpus, (process.name, tid, format_cpu_list(cpus))
            log = process.log_path.read_text()
            where = f"CPUs {placement.cpu_list}, intra-op threads {placement.threads}"
            assert where in log, (process.name, log[-2000:])
            # An engine process (a child of its worker) runs on its worker's CPUs too.
            for child in children(pid):
                assert set(thread_affinities(child).values()) == {placement.cpus}, process.name
    finally:
        cluster.stop()
