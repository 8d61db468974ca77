"""`nori bench transfer` as a user runs it: a real subprocess, one JSON object on stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("destinations", "bulk"), [("scattered", "mapped"), ("adjacent", "messages")]
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
        expected = "shared memory mapped by the receiver for " if bulk == "mapped" else "messages"
        assert report["ucx_transports"]["bulk"].startswith(expected)
        assert set(report["ucx_cpu_s_per_gib"]) == {"sender", "receiver"}
    # CPU seconds per GiB on each side (the receiver's counted in clock ticks: maybe 0 here).
    assert min(report["tcp_transport_cpu_s_per_gib"].values()) >= 0
    assert report["map_shared_memory"] == (bulk == "mapped")
    assert "auto_transport" not in report


def test_bench_transfer_rejects_bad_settings() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "bench", "transfer", "--block-kib", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "must be >= 1" in result.stderr


@pytest.mark.slow
def test_bench_transfer_between_two_hosts(tmp_path: Path) -> None:
    """`--listen` on one network namespace, `--receiver` on another: every transport crosses the
    veth link between them, as messages, and UCX says every lane it chose is TCP."""
    from nori.bench.netns_hosts import require_namespaces

    require_namespaces()
    out = tmp_path / "cross-host"
    command = ["--out", str(out), "--block-kib", "32", "--runs", "1", "--total-mib", "2"]
    command += ["--repeats", "1", "--transports", "ucx,tcp_transport,socket"]
    result = subprocess.run(
        [sys.executable, "-m", "nori.bench.cross_host_transfer", *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "run1-32kib.json").read_text())
    host, _ = report["receiver"].rsplit(":", 1)
    assert host.startswith("10.213.")  # the receiving namespace's address, not loopback
    assert report["map_shared_memory"] is False
    for key in ("tcp_transport_gbps", "socket_gbps"):
        assert report[key] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["leftovers"] == []
    if report["ucx_gbps"] is not None:
        assert report["ucx_transports"]["bulk"] == "messages"
        assert summary["by_block_kib"]["32"]["ucx_lanes_all_tcp"] is True


def test_the_listening_side_refuses_a_sender_without_the_cluster_secret() -> None:
    """What comes over `--listen`'s control connection is unpickled: a peer with another secret
    is refused at the handshake, and the listener goes on to serve one that holds it."""
    import multiprocessing.connection
    import os
    import time

    from nori.cluster_auth import CLUSTER_SECRET_ENV, ClusterAuth
    from nori.launch.local_cluster import free_port

    secret = "a-secret-of-this-test-0123456789"
    port = free_port()
    listener = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nori.cli.main",
            "bench",
            "transfer",
            "--listen",
            f"127.0.0.1:{port}",
        ],
        env={**os.environ, CLUSTER_SECRET_ENV: secret},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                wrong = ClusterAuth.from_text("another-secret-0123456789abcdef").key(
                    "bench-transfer"
                )
                multiprocessing.connection.Client(("127.0.0.1", port), authkey=wrong)
            except ConnectionRefusedError:
                assert listener.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
                continue
            except multiprocessing.AuthenticationError:
                break
            raise AssertionError("a sender with another secret was let in")
        right = ClusterAuth.from_text(secret).key("bench-transfer")
        with multiprocessing.connection.Client(("127.0.0.1", port), authkey=right) as conn:
            conn.send("quit")
        output, _ = listener.communicate(timeout=60)
    finally:
        if listener.poll() is None:
            listener.kill()
    assert listener.returncode == 0, output
    assert "refused a control connection" in output
