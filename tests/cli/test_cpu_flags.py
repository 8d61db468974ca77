"""The CPU and port flags of `nori serve` and `nori up` as a user types them: bad values are one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest


def nori(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "prefill", "--cpus", "0-x"], "nori: error: --cpus '0-x': "),
        (["serve", "decode", "--cpus", "100000"], "nori: error: --cpus '100000': CPU 100000 is"),
        (["serve", "gateway", "--cpus", "0", "--threads", "0"], "nori: error: --threads must be"),
        (["up", "--cpus-prefill", "3-1"], "nori: error: --cpus-prefill '3-1': "),
        (["up", "--cpus-gateway", "100000"], "nori: error: --cpus-gateway '100000': CPU 100000"),
        (["up", "--threads-decode", "0"], "nori: error: --threads-decode must be at least 1"),
    ],
)
def test_bad_cpu_flags_are_one_clear_line(args: list[str], message: str) -> None:
    result = nori(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(message), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_up_refuses_worker_args_that_are_not_engine_options() -> None:
    result = nori("up", "--worker-args=--no-prefix-caching --bogus 3")
    assert result.returncode == 2, result.stderr
    assert result.stderr == "nori: error: --worker-args: not an engine option: --bogus 3\n"


PINNED_EVERY_THREAD = """
import os, threading
from nori.cli.main import build_parser
from nori.worker.cpu_binding import CpuBinding, bind_process

args = build_parser().parse_args(["serve", "prefill", "--cpus", "{cpu}", "--threads", "1"])
import torch  # starts a thread of its own before the binding
before = len(os.listdir("/proc/self/task"))
bind_process(CpuBinding.from_flags(args.cpus, args.threads))
threading.Thread(target=lambda: None).start()  # a thread started after it inherits it
torch.ones(256, 256) @ torch.ones(256, 256)
tasks = os.listdir("/proc/self/task")
allowed = set()
for task in tasks:
    for line in open(f"/proc/self/task/{{task}}/status"):
        if line.startswith("Cpus_allowed_list:"):
            allowed.add(line.split()[1])
print(before, len(tasks), sorted(allowed), os.environ["OMP_NUM_THREADS"])
"""


def test_binding_pins_the_threads_that_exist_and_those_started_later() -> None:
    """Affinity is per thread: the threads that exist when `nori serve` binds the process (torch
    starts one on import) are pinned one by one, later ones inherit it."""
    cpu = min(os.sched_getaffinity(0))
    result = subprocess.run(
        [sys.executable, "-c", PINNED_EVERY_THREAD.format(cpu=cpu)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    before, total, allowed, omp = result.stdout.split(maxsplit=3)
    assert int(before) >= 1 and int(total) >= int(before)
    assert allowed == f"['{cpu}']" and omp.strip() == "1"


def test_up_on_a_busy_port_says_so_before_starting_anything() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = nori("up", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"nori: error: --port {port}: port in use"), result.stderr
    assert "Traceback" not in result.stderr
    # Refused up front: no Redis, no worker was started and waited for.
    assert time.monotonic() - started < 30


def test_up_names_the_per_pool_option_whose_args_are_not_engine_options() -> None:
    result = nori("up", "--prefill-args=--tensor-parallel-size 2 --bogus")
    assert result.returncode == 2, result.stderr
    assert result.stderr == "nori: error: --prefill-args: not an engine option: --bogus\n"
