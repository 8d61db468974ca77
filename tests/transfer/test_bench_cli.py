"""`nori bench transfer` as a user runs it: a real subprocess, one JSON object on stdout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("destinations", "bulk"), [("scattered", "auto"), ("adjacent", "messages")]
)
def test_bench_transfer_json(destinations: str, bulk: str) -> None:
    command = ["bench", "transfer", "--total-mib", "4", "--json", "--destinations", destinations]
    command += ["--bulk", bulk]
    result = subprocess.run(
        [sys.executable, "-m", "nori.cli.main", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("ucx_gbps", "socket_gbps", "memcpy_gbps", "tcp_transport_gbps"):
        assert key in report
    # Speeds are not asserted (shared CI machines); only that each ran and reported a rate.
    for key in ("socket_gbps", "memcpy_gbps", "tcp_transport_gbps"):
        assert report[key] > 0
    assert report["ucx_gbps"] is None or report["ucx_gbps"] > 0
    assert report["total_mib"] == 4 and report["num_blocks"] == 4 * 1024 // report["block_kib"]
    assert "median" in report["statistic"]
    assert report["destinations"] == destinations
    if report["ucx_gbps"] is not None:
        # Which UCX transports and protocols carried the bytes, from UCX's own log.
        assert report["ucx_transports"]["tag_send"]
        # What carried the bytes: copied by the receiver out of its mapping of this (the
        # sender's) shared memory, as the workers' KV caches are, which needs no permission to
        # read another process; or messages.
        expected = "shared memory mapped by the receiver for " if bulk == "auto" else "messages"
        assert report["ucx_transports"]["bulk"].startswith(expected)
        assert set(report["ucx_cpu_s_per_gib"]) == {"sender", "receiver"}
    # CPU seconds per GiB on each side (the receiver's counted in clock ticks: maybe 0 here).
    assert min(report["tcp_transport_cpu_s_per_gib"].values()) >= 0
    assert report["cross_memory_attach"] == (bulk == "auto")


def test_bench_transfer_rejects_bad_settings() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "bench", "transfer", "--block-kib", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "must be >= 1" in result.stderr
