"""compose.yaml run as local processes: what `docker compose up` would start, without Docker.

Each Nori service's command runs as `python -m nori.cli.main ...` with the service's own
environment, after Compose's `${VAR:-default}` interpolation. Service names resolve to
127.0.0.1 (here: rewritten in the environment), every port a command listens on is remapped to
a free one (replicas of a scaled service each get their own), and the third-party services are
stood in for: Redis by the redis service's own script run here (its ACL file written from the
secret files, then redis-server; `compose_redis`), Jaeger by the test's OTLP receiver. Secret
files are made as the file's comment says, in a folder that stands in for /run/secrets.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nori.launch.local_cluster import free_port

# The flags of a Nori command that open a listening port.
PORT_FLAGS = frozenset({"--port", "--metrics-port", "--transfer-port"})
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${NAME}` / `${NAME:-default}` (unset or empty: the default)."""
    return _VARIABLE.sub(lambda m: environ.get(m.group(1)) or (m.group(2) or ""), value)


def nori_services(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services running the Nori image that `docker compose up` starts (no profile)."""
    return {
        name: service
        for name, service in document["services"].items()
        if service.get("image") == "nori:latest" and not service.get("profiles")
    }


@dataclass
class Replica:
    service: str
    argv: list[str]
    env: dict[str, str]
    # The command's listening ports: flag -> the free port it got here.
    ports: dict[str, int]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nori.cli.main", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def plan_replicas(
    document: dict[str, Any],
    hosts: dict[str, str],
    scale: dict[str, int],
    environ: dict[str, str],
    log_dir: Path,
) -> list[Replica]:
    """A process per replica of each Nori service. `hosts`: "service:port" as the containers
    write it -> "127.0.0.1:port" where the stand-in listens."""
    replicas = []
    for name, service in nori_services(document).items():
        for index in range(scale.get(name, 1)):
            argv = [interpolate(part, environ) for part in service["command"]]
            for compose_address, local_address in hosts.items():
                argv = [part.replace(compose_address, local_address) for part in argv]
            ports = {}
            for position, part in enumerate(argv[:-1]):
                if part in PORT_FLAGS:
                    ports[part] = free_port()
                    argv[position + 1] = str(ports[part])
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            for key, value in dict(service.get("environment") or {}).items():
                value = interpolate(str(value), environ)
                for compose_address, local_address in hosts.items():
                    value = value.replace(compose_address, local_address)
                env[key] = value
            if env.get("NORI_ADVERTISE_HOST") == "auto":
                env["NORI_ADVERTISE_HOST"] = "127.0.0.1"  # a container's IP; here, this host
            replicas.append(Replica(name, argv, env, ports, log_dir / f"{name}-{index}.log"))
    return replicas


def health_command(service: dict[str, Any], replica: Replica) -> list[str]:
    """The service's health check, with its ports remapped like its command's."""
    test = [part for part in service["healthcheck"]["test"] if part != "CMD"]
    assert test[0] == "nori", test
    remapped = []
    for part in test[1:]:
        for flag, port in replica.ports.items():
            original = replica_port(service, flag)
            part = part.replace(f":{original}", f":{port}")
        remapped.append(part)
    return [sys.executable, "-m", "nori.cli.main", *remapped]


def replica_port(service: dict[str, Any], flag: str) -> str:
    command = service["command"]
    return str(command[command.index(flag) + 1])


def wait_healthy(check: list[str], env: dict[str, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(check, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{check} still unhealthy: {done.stderr}")
        time.sleep(1)


def make_secrets(document: dict[str, Any], folder: Path) -> Path:
    """Each secret compose.yaml declares, as deploy/make-secrets.sh makes them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in document["secrets"]:
        path = folder / name
        path.write_text(secrets.token_urlsafe(32) + "\n")
        path.chmod(0o644)
    return folder


def _container_paths(text: str, secrets_dir: Path, data_dir: Path) -> str:
    """A script of the redis service, as it runs here: Compose's `$$` unescaped, its secret and
    data folders moved."""
    return (
        text.replace("$$", "$")
        .replace("/run/secrets/", f"{secrets_dir}/")
        .replace("/data/", f"{data_dir}/")
    )


def compose_redis(
    document: dict[str, Any], binary: str, port: int, secrets_dir: Path, data_dir: Path, log: Path
) -> subprocess.Popen[bytes]:
    """The redis service's command (`sh -c SCRIPT`) run here, on 127.0.0.1:`port`; the image's
    entrypoint (which only drops root) is left out."""
    command = list(document["services"]["redis"]["command"])
    assert command[:2] == ["sh", "-c"], command
    script = _container_paths(command[2], secrets_dir, data_dir).replace(
        "docker-entrypoint.sh redis-server", f"{binary} --port {port} --bind 127.0.0.1"
    )
    with log.open("wb") as out:
        return subprocess.Popen(["sh", "-c", script], stdout=out, stderr=subprocess.STDOUT)


def compose_redis_health(
    document: dict[str, Any], port: int, secrets_dir: Path, data_dir: Path
) -> bool:
    """The redis service's own health check, against the server on `port`."""
    test = document["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL", test
    script = _container_paths(test[1], secrets_dir, data_dir).replace(
        "redis-cli", f"redis-cli -p {port}"
    )
    env = {key: value for key, value in os.environ.items() if key != "REDISCLI_AUTH"}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True).returncode == 0
