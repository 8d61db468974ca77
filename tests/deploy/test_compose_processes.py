"""`docker compose up --scale decode=2`, run as processes: a request succeeds through the
gateway, both decode replicas join, every health check passes, and the request's trace reaches
an OTLP/gRPC receiver that stands in for Jaeger. Redis is the redis service's own script (the
ACL file from the secrets, every role its own user and password file, the cluster secret from a
file), so the secrets as Compose wires them are what the cluster runs on; the redis health check
passes with the password and fails without."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml

from nori.launch.local_cluster import free_port
from nori.launch.redis_acl import READ_ONLY_PATTERNS_SINCE
from nori.launch.redis_server import redis_version
from tests.deploy.compose_processes import (
    compose_redis,
    compose_redis_health,
    health_command,
    make_secrets,
    nori_services,
    plan_replicas,
    wait_healthy,
)
from tests.telemetry.otlp_receiver import OTLPReceiver

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_run_as_processes_and_trace_a_request(tmp_path: Path) -> None:
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    binary = shutil.which("redis-server")
    if binary is None or redis_version(binary) < READ_ONLY_PATTERNS_SINCE:
        pytest.skip("needs redis-server 7 (the image's: read-only ACL key patterns)")
    secrets_dir = make_secrets(document, tmp_path / "secrets")
    port = free_port()
    server = compose_redis(document, binary, port, secrets_dir, tmp_path, tmp_path / "redis.log")
    try:
        deadline = time.monotonic() + 10
        while not compose_redis_health(document, port, secrets_dir, tmp_path):
            assert server.poll() is None, (tmp_path / "redis.log").read_text()
            assert time.monotonic() < deadline, "the redis service never became healthy"
            time.sleep(0.05)
        # Its health check logs in: without the password it fails.
        password = (secrets_dir / "redis_password").read_text().strip()
        (secrets_dir / "admin").write_text(password)
        (secrets_dir / "redis_password").write_text("wrong\n")
        assert not compose_redis_health(document, port, secrets_dir, tmp_path)
        _serve_through_compose(document, port, secrets_dir, tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=10)


def _serve_through_compose(
    document: dict[str, Any], redis_port: int, secrets_dir: Path, tmp_path: Path
) -> None:
    with OTLPReceiver() as jaeger:
        hosts = {
            "redis:6379": f"127.0.0.1:{redis_port}",
            "http://jaeger:4317": jaeger.endpoint,
            "/run/secrets/": f"{secrets_dir}/",
            "/var/lib/nori/batches": str(tmp_path / "batches"),
        }
        replicas = plan_replicas(
            document,
            hosts,
            scale={"decode": 2},
            environ={},  # the file's own defaults: NORI_MODEL=demo, NORI_PORT=8000, ...
            log_dir=tmp_path,
        )
        assert sorted(r.service for r in replicas) == [
            "batch",
            "decode",
            "decode",
            "gateway",
            "prefill",
        ]
        gateway = next(r for r in replicas if r.service == "gateway")
        runner = next(r for r in replicas if r.service == "batch")
        runner.argv[runner.argv.index("--gateway-url") + 1] = (
            f"http://127.0.0.1:{gateway.ports['--port']}"
        )
        for replica in replicas:
            # Export spans at once instead of every 5 s.
            replica.env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
            replica.start()
        try:
            services = nori_services(document)
            for replica in replicas:
                wait_healthy(health_command(services[replica.service], replica), replica.env, 300)
            gateway = next(r for r in replicas if r.service == "gateway")
            url = f"http://127.0.0.1:{gateway.ports['--port']}"
            # Each replica answers its own health check once it serves; the gateway sees it once
            # its registry entry is read, which on a loaded host can come a poll later.
            deadline = time.monotonic() + 30
            while (workers := httpx.get(f"{url}/health").json()["workers"]) != {
                "prefill": 1,
                "decode": 2,
            }:
                assert time.monotonic() < deadline, f"the gateway sees {workers}"
                time.sleep(0.2)
            # Their entries are signed with the cluster secret from its file.
            admin = redis.Redis(port=redis_port, password=(secrets_dir / "admin").read_text())
            try:
                entries = [admin.hgetall(key) for key in admin.scan_iter(match="nori:worker:*")]
            finally:
                admin.close()
            assert len(entries) == 3 and all(b"signature" in entry for entry in entries)
            # The API requires the key from the secrets; nothing gets in without it.
            assert openai_client_refused(url)
            api_key = (secrets_dir / "api_key").read_text().strip()
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key)
            raw = client.completions.with_raw_response.create(
                model="demo", prompt="Once upon a time", max_tokens=8
            )
            assert raw.parse().usage is not None and raw.parse().usage.completion_tokens > 0
            trace_id = raw.headers["x-trace-id"]
            spans = jaeger.wait_for(
                trace_id,
                lambda found: (
                    {"nori-gateway", "nori-prefill", "nori-decode"} <= {s.service for s in found}
                    and any(s.name == "generation" for s in found)
                ),
            )
            assert {s.trace_id for s in spans} == {trace_id}
            # The batch runner works the gateway's batches from the shared volume.
            line = {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "demo", "prompt": "Once", "max_tokens": 4},
            }
            uploaded = client.files.create(
                file=("in.jsonl", json.dumps(line).encode()), purpose="batch"
            )
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 120
            while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
                time.sleep(0.2)
                batch = client.batches.retrieve(batch.id)
            assert batch.status == "completed" and batch.request_counts.completed == 1, batch
            # Its line is a span of the runner's, linked to the span that created the batch,
            # and the gateway's handling of the line is that span's child.
            created = next(
                s for s in jaeger.spans() if s.name == "POST /v1/batches" and s.kind == 2
            )
            deadline = time.monotonic() + 30
            while not any(s.name == "batch line" for s in jaeger.spans()):
                assert time.monotonic() < deadline, "no span of the batch line"
                time.sleep(0.1)
            line_span = next(s for s in jaeger.spans() if s.name == "batch line")
            assert line_span.service == "nori-batch"
            assert (created.trace_id, created.span_id) in line_span.links
            assert line_span.attributes["nori.batch.id"] == batch.id
            jaeger.wait_for(
                line_span.trace_id,
                lambda found: any(
                    s.service == "nori-gateway" and s.parent_span_id == line_span.span_id
                    for s in found
                ),
            )
        except BaseException:
            for replica in replicas:
                print(f"--- {replica.service} ({replica.argv})\n{replica.log()}")
            raise
        finally:
            for replica in replicas:
                replica.stop()


def openai_client_refused(url: str) -> bool:
    """A client with a wrong key gets 401."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    try:
        client.models.list()
    except openai.AuthenticationError:
        return True
    return False
