"""Serving A/B across hosts: one colocated worker against 1 prefill + 1 decode worker, each
worker on a host of its own: network namespaces on one machine (`nori.bench.netns_hosts`).

    python -m nori.bench.cross_host_serving --model demo --out results/serving/cross-host

- colocated: Redis and the gateway on one host, one `nori serve decode --colocated` worker on
  another;
- disaggregated: Redis and the gateway on one host, a prefill worker on a second, a decode
  worker on a third; the KV blocks cross the hosts' links (`--transport`, default ucx: each
  host's private /dev/shm, IPC and PID namespaces leave UCX only TCP between them).

Every process is `nori serve ROLE` as compose.yaml starts it (`--host 0.0.0.0`, fixed ports,
NORI_ADVERTISE_HOST its host's address, a cluster secret), pinned as `nori up` pins a cluster
on these CPUs (`nori.launch.cpu_plan`): the colocated worker on all of them, the prefill and
decode workers on their halves, the gateway on the prefill's CPUs (all of them when colocated)
with one thread. So the comparison is the one-host `nori bench compare` one, but with the KV
crossing a network. Both clusters stay up for the whole comparison, and the runs alternate
(c, d, d, c, ...), each round with its own seed, both sides the same requests, as `nori bench
compare` runs them. The load is `nori bench serve` (default: bench/ab_serve.sh's, random 128 in
/ 128 out as token ids, 64 prompts at concurrency 16, ignore_eos, 16 warm-ups) from this
process's namespace, over the bridge.

Each run's `bench serve` JSON, the roles' logs, and a summary (JSON and a Markdown table: output
tok/s, median TTFT and ITL, medians over the rounds, and disaggregated / colocated) go to
`--out`. Needs root; everything is removed on the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nori.bench.cross_host_transfer import host_cpu, load_average
from nori.bench.netns_hosts import Host, HostProcess, Hosts, namespaces_unavailable
from nori.launch.cpu_plan import CpuRequest, format_cpu_list, plan_cpus
from nori.launch.redis_server import find_redis_server
from nori.models.demo import resolve_model
from nori.settings import Role

REDIS_PORT = 6379
GATEWAY_PORT = 8000
PREFILL_PORT = 50061
DECODE_PORT = 50071
TRANSFER_PORT = 50100
SIDES = ("colocated", "disaggregated")
# bench/ab_serve.sh's load: what the README's serving A/Bs run.
DEFAULT_LOAD = (
    "--dataset random --random-input-len 128 --random-output-len 128 --random-range-ratio 0 "
    "--prompt-format token-ids --num-prompts 64 --max-concurrency 16 --ignore-eos "
    "--num-warmups 16"
)
FIGURES = ("output_throughput", "median_ttft_ms", "median_itl_ms")
# UCX_PROTO_INFO's table rows end with the lane: "| 0..8191 | eager short | tcp/eth0 |".
_UCX_LANE = re.compile(r"\|\s*([a-z0-9_]+/[A-Za-z0-9_.:-]+)\s*\|\s*$")


@dataclass
class Cluster:
    """One side: its hosts (gateway first) and the processes started on them."""

    side: str
    hosts: dict[str, Host]
    log_dir: Path
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    processes: dict[str, HostProcess] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    @property
    def gateway(self) -> Host:
        return self.hosts["gateway"]

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}:{GATEWAY_PORT}"

    def env(self, host: Host, threads: int | None) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": f"redis://{self.gateway.address}:{REDIS_PORT}/0",
            "NORI_ADVERTISE_HOST": host.address,
            "NORI_CLUSTER_SECRET": self.secret,
            # UCX logs the lanes (transport/device) it picks per endpoint.
            "UCX_PROTO_INFO": "y",
        }
        if threads is not None:
            env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
        return env

    def spawn(self, name: str, host: Host, argv: list[str], threads: int | None) -> None:
        self.commands[name] = f"[{host.name} {host.address}] " + shlex.join(argv)
        log = self.log_dir / f"{self.side}-{name}.log"
        self.processes[name] = host.spawn(name, argv, log, self.env(host, threads))

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"{self.side} {name} exited ({process.poll()}):\n{process.log()}"
                )

    def stop(self) -> None:
        for name in ("gateway", "prefill", "decode", "colocated", "redis"):
            if name in self.processes:
                self.processes[name].stop(20)

    def ucx_lanes(self) -> list[str]:
        lanes = set()
        for name in ("prefill", "decode"):
            path = self.log_dir / f"{self.side}-{name}.log"
            if path.exists():
                for line in path.read_text(errors="replace").splitlines():
                    if found := _UCX_LANE.search(line):
                        lanes.add(found.group(1))
        return sorted(lanes)


def _nori(*args: str) -> list[str]:
    return [sys.executable, "-m", "nori.cli.main", *args]


def start_cluster(
    cluster: Cluster,
    redis_binary: str,
    model: str,
    worker_args: Sequence[str],
    transport: str,
    cpus: frozenset[int],
) -> None:
    """Redis and the gateway on the gateway host, the workers on theirs, pinned as `nori up`
    would pin them on `cpus` (`nori.launch.cpu_plan`)."""
    colocated = cluster.side == "colocated"
    plan = plan_cpus(
        cpus,
        CpuRequest(num_prefill=0 if colocated else 1, num_decode=1, colocated=colocated),
    )
    gateway = cluster.gateway
    cluster.spawn(
        "redis",
        gateway,
        [redis_binary, "--port", str(REDIS_PORT), "--bind", gateway.address,
         "--protected-mode", "no", "--save", "", "--appendonly", "no"],
        None,
    )  # fmt: skip
    roles: list[tuple[Role, str]] = (
        [("colocated", "decode")] if colocated else [("prefill", "prefill"), ("decode", "decode")]
    )
    for role, serve_role in roles:
        placement = plan.placement(f"{role}-0", role)
        argv = _nori(
            "serve", serve_role, "--host", "0.0.0.0",
            "--port", str(PREFILL_PORT if role == "prefill" else DECODE_PORT),
            "--worker-id", f"{role}-0", "--model", model, "--transport", transport,
            *worker_args, *placement.serve_args(),
        )  # fmt: skip
        if serve_role == "decode":
            argv += ["--transfer-port", str(TRANSFER_PORT)]
        if colocated:
            argv.append("--colocated")
        cluster.spawn(role, cluster.hosts[role], argv, placement.threads)
    placement = plan.placement("gateway", "gateway")
    argv = _nori(
        "serve", "gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--model", model,
        "--max-queued-prompt-tokens", "8192", "--disaggregation", "always",
        *placement.serve_args(),
    )  # fmt: skip
    cluster.spawn("gateway", gateway, argv, placement.threads)


def wait_healthy(cluster: Cluster, expected: dict[str, int], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    seen: object = None
    with httpx.Client(trust_env=False, timeout=5) as http:
        while True:
            cluster.check_alive()
            try:
                seen = http.get(f"{cluster.url}/health").json().get("workers")
            except (httpx.HTTPError, ValueError):
                seen = None
            if seen == expected:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cluster.side}: the gateway sees {seen}, not {expected}")
            time.sleep(0.5)


def bench_serve(
    cluster: Cluster, tokenizer: str, load: Sequence[str], seed: int, result_file: Path
) -> tuple[dict[str, Any], str]:
    """`nori bench serve` against the cluster's gateway (from this namespace); its JSON."""
    argv = _nori(
        "bench", "serve", "--base-url", cluster.url, "--tokenizer", tokenizer, *load,
        "--seed", str(seed), "--json", "--result-file", str(result_file),
    )  # fmt: skip
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve exited {done.returncode}:\n{done.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(result_file.read_text())
    return report, shlex.join(argv)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    sides: dict[str, Any] = {}
    for side in SIDES:
        reports = [run["report"] for run in runs if run["side"] == side]
        sides[side] = {
            "runs": {key: [round(float(r[key]), 2) for r in reports] for key in FIGURES},
            "median": {
                key: round(statistics.median(float(r[key]) for r in reports), 2) for key in FIGURES
            },
            "failed": sum(int(r.get("failed", 0)) for r in reports),
        }
    sides["disaggregated_vs_colocated"] = {
        key: round(sides["disaggregated"]["median"][key] / sides["colocated"]["median"][key], 3)
        for key in FIGURES
    }
    return sides


def run_model(
    hosts: Hosts,
    model_arg: str,
    args: argparse.Namespace,
    out: Path,
    redis_binary: str,
    cpus: frozenset[int],
) -> dict[str, Any]:
    model = str(resolve_model(model_arg))
    worker_args = shlex.split(args.worker_args.get(model_arg, ""))
    load = shlex.split(args.load)
    model_out = out / model_arg
    log_dir = model_out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    clusters = {
        "colocated": Cluster(
            "colocated",
            {"gateway": hosts["c-gateway"], "colocated": hosts["c-worker"]},
            log_dir,
        ),
        "disaggregated": Cluster(
            "disaggregated",
            {
                "gateway": hosts["d-gateway"],
                "prefill": hosts["d-prefill"],
                "decode": hosts["d-decode"],
            },
            log_dir,
        ),
    }
    runs: list[dict[str, Any]] = []
    commands: dict[str, Any] = {}
    try:
        for cluster in clusters.values():
            start_cluster(cluster, redis_binary, model, worker_args, args.transport, cpus)
        wait_healthy(clusters["colocated"], {"colocated": 1}, args.startup_timeout_s)
        wait_healthy(clusters["disaggregated"], {"prefill": 1, "decode": 1}, args.startup_timeout_s)
        for round_ in range(1, args.rounds + 1):
            order = SIDES if round_ % 2 else tuple(reversed(SIDES))
            for side in order:
                cluster = clusters[side]
                load_before = load_average()
                report, command = bench_serve(
                    cluster,
                    model,
                    load,
                    args.seed + round_,
                    model_out / f"{side}-{round_}.json",
                )
                commands["bench_serve"] = command.replace(cluster.url, "http://GATEWAY:8000")
                runs.append(
                    {"side": side, "round": round_, "report": report, "load_before": load_before}
                )
                print(
                    f"{model_arg} round {round_} {side}: "
                    + ", ".join(f"{key} {float(report[key]):.2f}" for key in FIGURES)
                    + f" (failed {report.get('failed')}, load {load_before})",
                    flush=True,
                )
        commands["roles"] = {side: c.commands for side, c in clusters.items()}
        lanes = clusters["disaggregated"].ucx_lanes()
    finally:
        for cluster in clusters.values():
            cluster.stop()
    summary = {
        "model": model_arg,
        "checkpoint": model,
        "worker_args": worker_args,
        "transport": args.transport,
        "load": load,
        "rounds": args.rounds,
        "commands": commands,
        "disaggregated_ucx_lanes": lanes,
        "sides": summarize(runs),
        "load_average_per_run": [(r["side"], r["round"], r["load_before"]) for r in runs],
    }
    (model_out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def markdown(summaries: list[dict[str, Any]], cpu: dict[str, Any], loads: list[Any]) -> str:
    lines = [
        f"Cross-host serving A/B ({cpu['model_name']}, {cpu['cpu_count']} CPUs, avx512_bf16 "
        f"{cpu['avx512_bf16']}, AMX {cpu['amx'] or 'none'}): medians of the rounds, each side's "
        "workers on hosts (network namespaces) of their own.",
        "",
        "| model | side | output tok/s | median TTFT ms | median ITL ms |",
        "|---|---|---|---|---|",
    ]
    for summary in summaries:
        sides = summary["sides"]
        for side in SIDES:
            m = sides[side]["median"]
            lines.append(
                f"| {summary['model']} | {side} | {m['output_throughput']:.1f} | "
                f"{m['median_ttft_ms']:.1f} | {m['median_itl_ms']:.2f} |"
            )
        r = sides["disaggregated_vs_colocated"]
        lines.append(
            f"| {summary['model']} | disaggregated / colocated | {r['output_throughput']:.3f}x | "
            f"{r['median_ttft_ms']:.3f}x | {r['median_itl_ms']:.3f}x |"
        )
    lines += ["", f"Load average (1, 5, 15 min) at start and end: {loads}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nori.bench.cross_host_serving")
    parser.add_argument("--model", default="demo", help="comma-separated models, in turn")
    parser.add_argument("--out", default="results/serving/cross-host")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transport", choices=("ucx", "tcp"), default="ucx")
    parser.add_argument(
        "--worker-args",
        action="append",
        default=[],
        metavar="MODEL='ARGS'",
        help="engine options for one model's workers, e.g. "
        "smollm2-135m-instruct='--dtype bfloat16' (repeatable)",
    )
    parser.add_argument("--load", default=DEFAULT_LOAD, help="`nori bench serve` options")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    args.worker_args = dict(item.split("=", 1) for item in args.worker_args)
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"cross_host_serving: {reason}", file=sys.stderr)
        return 2
    redis_binary = find_redis_server()
    if redis_binary is None:
        print("cross_host_serving: no redis-server", file=sys.stderr)
        return 2
    cpus = frozenset(os.sched_getaffinity(0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loads = [load_average()]
    summaries = []
    started = time.time()
    names = ("c-gateway", "c-worker", "d-gateway", "d-prefill", "d-decode")
    with Hosts(names) as hosts:
        for model_arg in args.model.split(","):
            summaries.append(run_model(hosts, model_arg, args, out, redis_binary, cpus))
    loads.append(load_average())
    cpu = host_cpu()
    combined = {
        "cpu": cpu,
        "cpus": format_cpu_list(cpus),
        "driver_command": shlex.join(
            ["python", "-m", "nori.bench.cross_host_serving", *(argv or sys.argv[1:])]
        ),
        "wall_s": round(time.time() - started, 1),
        "load_average": loads,
        "models": summaries,
        "leftovers": hosts.leftovers(),
    }
    name = "summary" if len(summaries) > 1 else f"summary-{summaries[0]['model']}"
    (out / f"{name}.json").write_text(json.dumps(combined, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(summaries, cpu, loads))
    print(markdown(summaries, cpu, loads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
