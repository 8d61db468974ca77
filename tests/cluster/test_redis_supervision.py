"""`nori up` supervises its private Redis: kill -9 it and it is started again, and said so.

The real `nori up` as a subprocess, without REDIS_URL, so it runs its own redis-server (a
password, a user per role). This test reads the password from that server's ACL file, as only
the same OS user can; nothing the launcher prints holds it.

1. kill -9 of redis-server: `nori up` starts it again at once on the same port, with the same
   credentials (a client without the password is still refused), and prints so; the live
   workers re-register within 2 s of its return (their heartbeats retry every 0.25 s).
2. A longer outage, during which a decode worker is killed (-9): redis-server is killed and its
   port held by the test, so `nori up` cannot start it again (it says so once, and keeps trying).
   The killed worker is restarted by `nori up`, finds no Redis, says so once, loads its engine
   and waits: no crash loop. When the port is let go, `nori up` starts Redis and the worker
   registers within 2 s of its return (the issue's bound is 5 s); requests succeed afterwards.

tests/cluster/test_redis_outage.py covers the serving side of an outage (requests in flight
through it, under load); this one covers who brings Redis back and who rejoins.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from nori.launch.local_cluster import free_port
from nori.state.keys import Keys
from tests.cluster.test_nori_up import start_up, wait_for_line

pytestmark = pytest.mark.slow

# The bound is 5 s; heartbeats and a waiting worker retry every 0.25 s.
REJOIN_S = 2.0


def _redis_of(launcher: int) -> psutil.Process:
    (found,) = [
        child for child in psutil.Process(launcher).children() if child.name() == "redis-server"
    ]
    return found


def _admin_password(server: psutil.Process) -> str:
    """The default user's password, from the ACL file in the server's directory (its cwd)."""
    acl = (Path(server.cwd()) / "users.acl").read_text()
    (default,) = [line for line in acl.splitlines() if line.startswith("user default on >")]
    return default.split()[3].removeprefix(">")


def _registered(port: int, password: str, keys: Keys, worker_id: str) -> float | None:
    """The worker's started_at if its signed entry is in Redis, else None (also when Redis
    does not answer)."""
    client = redis.Redis(port=port, password=password, socket_timeout=0.5, retry=None)
    try:
        entry = client.hgetall(keys.worker(worker_id))
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    if b"signature" not in entry:
        return None
    return float(entry[b"started_at"])


def _seconds_until(condition: object, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


class PortHolder:
    """Holds a TCP port: accepts each connection and closes it at once (a Redis that is away)."""

    def __init__(self, port: int) -> None:
        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", port))
        self._socket.listen(64)
        self._socket.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except OSError:
                continue
            connection.close()

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


def _kill_and_hold(launcher: int, port: int) -> PortHolder:
    """kill -9 of redis-server, and its port taken before `nori up` can start it again."""
    for _ in range(5):
        server = _redis_of(launcher)
        server.kill()
        server.wait(5)
        try:
            return PortHolder(port)
        except OSError:  # `nori up` was quicker: kill the new one
            time.sleep(0.05)
    raise AssertionError("could not take the Redis port")


def _complete(base: str, model: str) -> int:
    response = httpx.post(
        f"{base}/v1/completions",
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 3},
        timeout=30,
    )
    return response.status_code


def test_up_restarts_its_redis_and_a_worker_killed_meanwhile_rejoins(
    checkpoint: Path, tmp_path: Path
) -> None:
    port, namespace = free_port(), f"test-up-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    args = ["--model", str(checkpoint), "--port", str(port), "--namespace", namespace]
    process = start_up([*args, "--no-cpu-pinning"], None, tmp_path)
    base = f"http://127.0.0.1:{port}"
    holder: PortHolder | None = None
    try:
        printed = wait_for_line(process, "curl", timeout_s=180)
        assert any("(private redis-server)" in line for line in printed), printed
        server = _redis_of(process.pid)
        password = _admin_password(server)
        (redis_port,) = {
            c.laddr.port for c in server.net_connections("tcp") if c.status == psutil.CONN_LISTEN
        }
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port, socket_timeout=2, retry=None).ping()
        assert _complete(base, checkpoint.name) == 200

        # 1. kill -9: started again at once, announced, the workers back within REJOIN_S.
        server.kill()
        printed += wait_for_line(process, "nori: redis-server exited", timeout_s=10)
        assert (
            f"nori: redis-server exited (status -9); restarted on port {redis_port}" in printed[-1]
        )
        restarted = _redis_of(process.pid)
        # From the new server process's start, before it even listens: an upper bound.
        back_at = restarted.create_time()
        assert restarted.pid != server.pid
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port, socket_timeout=2, retry=None).ping()
        for worker in ("prefill-0", "decode-0"):
            _seconds_until(lambda w=worker: _registered(redis_port, password, keys, w), 10)
        rejoined = time.time() - back_at
        print(f"\nworkers re-registered {rejoined:.2f} s after Redis returned")
        assert rejoined < REJOIN_S

        # 2. A longer outage, and decode-0 killed during it.
        decode = next(
            p for p in psutil.Process(process.pid).children() if "decode-0" in p.cmdline()
        )
        started_before = _registered(redis_port, password, keys, "decode-0")
        holder = _kill_and_hold(process.pid, redis_port)
        printed += wait_for_line(process, "restarting it failed, retrying", timeout_s=10)
        decode.kill()
        printed += wait_for_line(process, "nori: decode-0 restarted (restart 1)", timeout_s=15)
        log = tmp_path / "logs" / "decode-0.log"
        _seconds_until(
            lambda: "decode worker decode-0 ready; waiting for Redis" in log.read_text(), 120
        )
        # It waited, it did not exit: Redis' absence was said once.
        restarted_part = log.read_text().rpartition("--- restarted at")[2]
        assert restarted_part.count("cannot reach Redis at") == 1, restarted_part
        holder.release()
        holder = None
        printed += wait_for_line(process, "nori: redis-server exited", timeout_s=10)
        assert f"; restarted on port {redis_port}" in printed[-1], printed[-1]
        back_at = _redis_of(process.pid).create_time()

        def decode_rejoined() -> bool:
            started = _registered(redis_port, password, keys, "decode-0")
            return started is not None and started != started_before

        _seconds_until(decode_rejoined, 10)
        rejoined = time.time() - back_at
        print(f"the decode worker killed in the outage registered {rejoined:.2f} s after")
        assert rejoined < REJOIN_S
        deadline = time.monotonic() + 10
        while _complete(base, checkpoint.name) != 200:
            assert time.monotonic() < deadline, "not served after Redis returned"
            time.sleep(0.1)
        assert [_complete(base, checkpoint.name) for _ in range(5)] == [200] * 5

        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=90)
        assert process.returncode == 0, output
        everything = "\n".join(printed) + output
        # Once each: no crash loop, and the failed restarts were said once.
        assert "decode-0 restarted (restart 2)" not in everything, everything
        assert everything.count("restarting it failed") == 1, everything
        assert password not in everything
    finally:
        if holder is not None:
            holder.release()
        if process.poll() is None:
            process.kill()
            process.wait()
