"""`nori up`: a whole local cluster (Redis, gateway, prefill and decode workers) in one command."""

from __future__ import annotations

import argparse
import os
import signal
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="run a local cluster: gateway, prefill and decode workers as processes"
    )
    parser.add_argument("--model", default="demo", help="model folder, or 'demo'")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="one worker doing prefill and decode (the baseline for disaggregation)",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--transport", default="auto", choices=["auto", "ucx", "tcp"])
    parser.add_argument("--kv-lease-s", type=float, default=10.0)
    parser.add_argument("--kv-queue-timeout-s", type=float, default=60.0)
    parser.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=8192,
        help="gateway admission bound per prefill (or colocated) worker; 0 = no bound",
    )
    parser.add_argument("--namespace", default="nori", help="prefix of every Redis key")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default=None, help="where each process writes its log")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nori.cli.serve import served_model_name
    from nori.models.demo import resolve_model
    from nori.serving.local_cluster import ClusterSpec, LocalCluster
    from nori.state.redis_server import RedisUnavailable, resolve_redis_url

    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must be at least 1")
    # Create the demo checkpoint once here, not concurrently in every process.
    resolve_model(args.model)
    model = args.model
    try:
        redis_url, redis_server = resolve_redis_url(os.environ.get("REDIS_URL") or None)
    except RedisUnavailable as error:
        raise ValueError(
            f"{error}\nInstall Redis (e.g. `apt-get install redis-server`) or point REDIS_URL "
            "at a running server."
        ) from None
    spec = ClusterSpec(
        redis_url=redis_url,
        model=model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        colocated=args.colocated,
        port=args.port,
        namespace=args.namespace,
        served_model_name=served_model_name(args.model, args.served_model_name),
        transport=args.transport,
        kv_lease_s=args.kv_lease_s,
        kv_queue_timeout_s=args.kv_queue_timeout_s,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster = LocalCluster(spec)
    try:
        where = "private redis-server" if redis_server is not None else "REDIS_URL"
        print(f"nori: Redis at {redis_url} ({where}); starting the cluster...", flush=True)
        cluster.start(timeout_s=args.startup_timeout_s)
        name = spec.served_model_name
        print(
            f"nori: serving {name!r} at {cluster.url}/v1 "
            f"({'colocated' if args.colocated else f'{args.prefill} prefill, {args.decode} decode'})"
            f"\n  curl {cluster.url}/v1/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{name}", "prompt": "Once upon a time", "max_tokens": 32}}'"""
            f"\n  logs: {cluster.processes[0].log_path.parent}; Ctrl-C stops everything",
            flush=True,
        )
        while not stop.wait(0.5):
            cluster.check_alive()
    except RuntimeError as error:
        print(f"nori: error: {error}", flush=True)
        return 1
    finally:
        print("nori: stopping the cluster...", flush=True)
        cluster.stop()
        if redis_server is not None:
            redis_server.stop()
    print("nori: stopped", flush=True)
    return 0
