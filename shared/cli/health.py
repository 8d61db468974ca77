"""`nori health TARGET`: is a role up? The container health check of every Nori service.

TARGET is an HTTP(S) URL (healthy on a 2xx answer) or a worker's gRPC HOST:PORT (healthy when
its gRPC health service says SERVING). Exit 0 when healthy, 1 when not."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "health", help="check that a role is up (container health checks)"
    )
    parser.add_argument("target", help="http(s)://... (a 2xx answer) or HOST:PORT (gRPC health)")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.set_defaults(handler=run)


def _http_healthy(url: str, timeout_s: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300, f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}"
    except (OSError, ValueError) as error:
        return False, str(error)


def _grpc_healthy(address: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as error:
            return False, f"gRPC {error.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    return answer.status == health_pb2.HealthCheckResponse.SERVING, status


def run(args: argparse.Namespace) -> int:
    target: str = args.target
    if target.startswith(("http://", "https://")):
        healthy, detail = _http_healthy(target, args.timeout_s)
    elif ":" in target:
        healthy, detail = _grpc_healthy(target, args.timeout_s)
    else:
        raise ValueError(f"TARGET must be an http(s):// URL or HOST:PORT, got {target!r}")
    print(f"{target}: {'healthy' if healthy else 'unhealthy'} ({detail})", file=sys.stderr)
    return 0 if healthy else 1
