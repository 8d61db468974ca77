"""A whole cluster on one machine, each role its own OS process (`nori up`, end-to-end tests).

The processes are what containers run (`nori serve ROLE ...`), sharing one Redis and namespace.
This waits until every role is healthy, restarts a role that exits (`supervise`) and stops them
in order: batch runners, gateway, then workers (each drains on SIGTERM).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nori.launch.cpu_plan import CpuPlan
from nori.launch.role_process import RoleProcess, start_process
from nori.settings import (
    DEFAULT_DISAGGREGATION,
    DEFAULT_KV_LEASE_S,
    DEFAULT_MAX_LOCAL_COMPUTE_S,
    DisaggregationMode,
    Role,
    RoleSettings,
    WorkerRole,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket() as probe:
        # As the gateway binds: a port in TIME_WAIT is free to listen on again.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ValueError(f"--port {port}: port in use on {host} ({error.strerror})") from None


@dataclass(frozen=True)
class ClusterSpec(RoleSettings):
    model: str = "demo"
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    port: int = 8000
    host: str = "127.0.0.1"  # the gateway's; workers stay on 127.0.0.1
    served_model_name: str | None = None
    transport: str | None = None  # "ucx" or "tcp"; None: each worker's default
    kv_lease_s: float = DEFAULT_KV_LEASE_S
    kv_queue_timeout_s: float = 60.0
    kv_transfer_timeout_s: float = 30.0
    # Gateway admission, per worker computing prompts; 0 = no bound.
    max_queued_prompt_tokens: int = 8192
    stream_interval: int = 1
    disaggregation: DisaggregationMode = DEFAULT_DISAGGREGATION
    max_local_compute_s: float = DEFAULT_MAX_LOCAL_COMPUTE_S
    # The workers' --max-model-len, which the gateway checks requests against too.
    max_model_len: int | None = None
    verbose: bool = False
    chat_template: str | None = None
    tokenizer: str | None = None
    # Passed in the gateway's environment, never on a command line; None: open.
    api_key: str | None = None
    otlp_traces_endpoint: str | None = None
    # Extra flags for every worker.
    worker_args: tuple[str, ...] = ()
    # Extra flags for the prefill (or decode and colocated) workers only, after worker_args.
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    cpu_plan: CpuPlan | None = None  # None: unpinned
    # A role's own Redis URL (its ACL user); a role not named uses redis_url. Never printed.
    role_redis_urls: tuple[tuple[Role, str], ...] = field(default=(), repr=False)
    # The Batch API's directory and its runners; None: no Batch API.
    batch_dir: Path | None = None
    num_batch_runners: int = 1
    batch_runner_args: tuple[str, ...] = ()

    def redis_url_of(self, role: Role) -> str:
        return dict(self.role_redis_urls).get(role, self.redis_url)


@dataclass
class LocalCluster:
    spec: ClusterSpec
    processes: list[RoleProcess] = field(default_factory=list)
    _log_dir: Path | None = None

    @property
    def url(self) -> str:
        wildcard = self.spec.host in ("0.0.0.0", "::", "")
        host = "127.0.0.1" if wildcard else self.spec.host
        return f"http://{host}:{self.spec.port}"

    def _gateway_options(self) -> list[str]:
        options = []
        if self.spec.batch_dir is not None:
            options += ["--batch-dir", str(self.spec.batch_dir)]
        if self.spec.max_model_len is not None:
            options += ["--max-model-len", str(self.spec.max_model_len)]
        if self.spec.chat_template is not None:
            options += ["--chat-template", self.spec.chat_template]
        if self.spec.tokenizer is not None:
            options += ["--tokenizer", self.spec.tokenizer]
        if self.spec.stream_interval != 1:
            options += ["--stream-interval", str(self.spec.stream_interval)]
        if self.spec.disaggregation != DEFAULT_DISAGGREGATION:
            options += ["--disaggregation", self.spec.disaggregation]
        if self.spec.max_local_compute_s != DEFAULT_MAX_LOCAL_COMPUTE_S:
            options += ["--max-local-compute-s", str(self.spec.max_local_compute_s)]
        return options

    def start(
        self, timeout_s: float = 120.0, on_healthy: Callable[[str], None] | None = None
    ) -> LocalCluster:
        """Spawns every role and waits until all are healthy; `on_healthy` hears each role's
        name once it is (the gateway first)."""
        self._log_dir = self.spec.log_dir or Path(tempfile.mkdtemp(prefix="nori-up-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.colocated:
            self.add_worker("colocated", "colocated-0")
        else:
            for index in range(self.spec.num_prefill):
                self.add_worker("prefill", f"prefill-{index}")
            for index in range(self.spec.num_decode):
                self.add_worker("decode", f"decode-{index}")
        self._spawn(
            "gateway",
            "gateway",
            [
                "serve",
                "gateway",
                "--host",
                self.spec.host,
                "--port",
                str(self.spec.port),
                "--model",
                self.spec.model,
                "--max-queued-prompt-tokens",
                str(self.spec.max_queued_prompt_tokens),
                *self._gateway_options(),
                *self._common_args(),
            ],
        )
        if self.spec.batch_dir is not None:
            for index in range(self.spec.num_batch_runners):
                self.add_batch_runner(f"batch-{index}")
        expected: dict[WorkerRole, int] = (
            {"colocated": 1}
            if self.spec.colocated
            else {"prefill": self.spec.num_prefill, "decode": self.spec.num_decode}
        )
        self.wait_healthy(expected, timeout_s, on_healthy)
        return self

    def add_worker(
        self, role: WorkerRole, worker_id: str, extra_args: Sequence[str] = ()
    ) -> RoleProcess:
        """Starts one more worker (via the registry); `extra_args` override the worker flags."""
        serve_role = "decode" if role == "colocated" else role
        args = [
            "serve",
            serve_role,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--worker-id",
            worker_id,
            "--model",
            self.spec.model,
            *(("--transport", self.spec.transport) if self.spec.transport else ()),
            *self._common_args(),
            *self.spec.worker_args,
            *(self.spec.prefill_args if role == "prefill" else self.spec.decode_args),
        ]
        if role == "colocated":
            args.append("--colocated")
        if role == "decode":
            args += ["--kv-lease-s", str(self.spec.kv_lease_s)]
            args += ["--kv-queue-timeout-s", str(self.spec.kv_queue_timeout_s)]
            args += ["--kv-transfer-timeout-s", str(self.spec.kv_transfer_timeout_s)]
        return self._spawn(worker_id, role, [*args, *extra_args])

    def add_batch_runner(self, name: str, extra_args: Sequence[str] = ()) -> RoleProcess:
        assert self.spec.batch_dir is not None
        args = [
            "serve",
            "batch",
            "--batch-dir",
            str(self.spec.batch_dir),
            "--gateway-url",
            self.url,
            "--runner-id",
            f"{name}-{len(self.processes)}",
            *self._common_args(),
            *self.spec.batch_runner_args,
        ]
        return self._spawn(name, "batch", [*args, *extra_args])

    def worker(self, name: str) -> RoleProcess:
        """A worker process, with its gRPC address as stated in the registry."""
        found = next(p for p in self.processes if p.name == name)
        if found.role != "gateway":
            found.grpc_address = self._registered_address(name) or found.grpc_address
        return found

    def _registered_address(self, worker_id: str) -> str:
        import redis

        from nori.state.keys import Keys

        client = redis.Redis.from_url(self.spec.redis_url)
        try:
            value = client.hget(Keys(self.spec.namespace).worker(worker_id), "grpc_address")
        finally:
            client.close()
        return value.decode() if isinstance(value, bytes) else ""

    def _common_args(self) -> list[str]:
        # The Redis URL (it may hold a password) travels in REDIS_URL, never on the command line.
        args = ["--namespace", self.spec.namespace]
        if self.spec.served_model_name:
            args += ["--served-model-name", self.spec.served_model_name]
        if self.spec.otlp_traces_endpoint:
            args += ["--otlp-traces-endpoint", self.spec.otlp_traces_endpoint]
        return args

    def _spawn(self, name: str, role: Role, args: list[str]) -> RoleProcess:
        assert self._log_dir is not None
        log_path = self._log_dir / f"{name}.log"
        redis_url = self.spec.redis_url_of(role)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "REDIS_URL": redis_url}
        if role in ("gateway", "batch") and self.spec.api_key:
            env["NORI_API_KEY"] = self.spec.api_key
        if self.spec.cluster_secret:
            env["NORI_CLUSTER_SECRET"] = self.spec.cluster_secret
        plan = self.spec.cpu_plan
        if plan is not None:
            ordinal = sum(1 for p in self.processes if p.role == role)
            placement = plan.placement(name, role, ordinal)
            if role == "batch":  # an HTTP client: beside the gateway, one thread
                gateway = plan.placement("gateway", "gateway")
                placement = dataclasses.replace(placement, cpus=gateway.cpus, threads=1)
            args = [*args, *placement.serve_args()]
            env.update(placement.env())
        argv = [
            sys.executable,
            "-m",
            "nori.cli.main",
            *(["-v"] if self.spec.verbose else []),
            *args,
        ]
        role_process = RoleProcess(
            name, start_process(argv, env, log_path, "wb"), log_path, role=role, argv=argv, env=env
        )
        self.processes.append(role_process)
        return role_process

    def health(self) -> dict[str, object] | None:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return dict(json.loads(response.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_healthy(
        self,
        expected: dict[WorkerRole, int],
        timeout_s: float = 120.0,
        on_healthy: Callable[[str], None] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        told: set[str] = set()

        def tell(name: str) -> None:
            if on_healthy is not None and name not in told:
                told.add(name)
                on_healthy(name)

        while time.monotonic() < deadline:
            self.check_alive()
            health = self.health()
            if health is not None:
                tell("gateway")
            workers = health.get("workers", {}) if health else {}
            if not isinstance(workers, dict):
                workers = {}
            for role, count in expected.items():
                if int(workers.get(role, 0)) >= count:
                    tell(f"{count} {role} worker{'s' if count > 1 else ''}")
            if all(int(workers.get(role, 0)) >= count for role, count in expected.items()):
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"the cluster was not healthy within {timeout_s:.0f}s (expected {expected}); "
            f"logs in {self._log_dir}"
        )

    def supervise(self) -> list[str]:
        """Restarts roles that exited unexpectedly, with backoff; what happened, one line each."""
        now = time.monotonic()
        return [event for role in self.processes if (event := role.supervise(now)) is not None]

    def check_alive(self) -> None:
        for role in self.processes:
            code = role.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"{role.name} exited with status {code}; its log ends with:\n{role.log_tail()}"
                )

    def stop(self, timeout_s: float = 30.0) -> None:
        runners = [p for p in self.processes if p.role == "batch"]
        gateways = [p for p in self.processes if p.name == "gateway"]
        workers = [p for p in self.processes if p.name != "gateway" and p.role != "batch"]
        for group in (runners, gateways, workers):
            for role in group:
                if role.process.poll() is None:
                    role.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for role in group:
                try:
                    role.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    role.process.kill()
                    role.process.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
