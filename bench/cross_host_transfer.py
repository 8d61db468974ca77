"""`nori bench transfer` between two hosts: network namespaces on one machine
(`nori.bench.netns_hosts`), joined by veth links on a bridge.

    python -m nori.bench.cross_host_transfer --out results/transfer/cross-host

The receiving host runs `nori bench transfer --listen ADDRESS:PORT`, the sending host `nori bench
transfer --receiver ADDRESS:PORT --bulk messages --json ...`: UCX, our TCP transport and the
plain socket all cross the same link, between the two hosts' addresses. Each host has its own
IPC, PID and mount namespaces (a private /dev/shm), so no same-host path is open to UCX (its
shared-memory and CMA transports) or to our transports (their shared-memory path is off besides); the
report's `ucx_transports` lanes say what UCX used, and this driver records whether every lane is
TCP. memcpy and the checksums are measured on the sending host, as on one host.

Each block size is run `--runs` times, the sizes alternating within a round (32, 256, 32, 256,
...), every run a fresh pair of processes; each run's figures are the median of its `--repeats`
timed repeats, and the summary gives the median over the runs. Every run's JSON report, and the
summary (JSON and a Markdown table), go to `--out`. Needs root (namespaces); the hosts, their
processes and the bridge are removed on the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from nori.bench.netns_hosts import Hosts, namespaces_unavailable

# The receivers' control port on the receiving host (a namespace of its own: always free).
CONTROL_PORT = 47300
FIGURES = ("ucx_gbps", "tcp_transport_gbps", "socket_gbps", "memcpy_gbps")
_RUN_TIMEOUT_S = 600.0


def host_cpu() -> dict[str, Any]:
    """The CPU model and the flags that matter to CPU inference (bf16 / AMX)."""
    model, flags = "", set[str]()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return {
        "model_name": model,
        "cpu_count": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": sorted(flag for flag in flags if flag.startswith("amx")),
    }


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def lanes_all_tcp(report: dict[str, Any]) -> bool | None:
    """Whether every lane UCX chose is TCP (None: no UCX figures in the report)."""
    lanes = (report.get("ucx_transports") or {}).get("lanes")
    if not lanes:
        return None
    found = [lane for line in lanes for lane in re.findall(r"\(([^)]*)\)", line)]
    return all(
        transport.startswith("tcp/") for group in found for transport in group.split()
    ) and bool(found)


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
    raise RuntimeError(f"no JSON report in the sender's output:\n{text[-4000:]}")


def run_once(
    hosts: Hosts, bench_args: list[str], log_dir: Path, name: str, env: dict[str, str]
) -> dict[str, Any]:
    """One sender/receiver pair; the sender's report."""
    sender, receiver = hosts["sender"], hosts["receiver"]
    control = f"{receiver.address}:{CONTROL_PORT}"
    nori = [sys.executable, "-m", "nori.cli.main", "bench", "transfer"]
    listening = receiver.spawn(
        f"{name}-receiver", [*nori, "--listen", control], log_dir / f"{name}-receiver.log", env
    )
    command = [*nori, "--receiver", control, "--json", *bench_args]
    sending = sender.spawn(f"{name}-sender", command, log_dir / f"{name}-sender.log", env)
    try:
        code = sending.wait(_RUN_TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"{name}: the sender exited {code}:\n{sending.log()}")
        listening.wait(30)  # it exits once the sender said it is done
        return _last_json(sending.log_path.read_text(errors="replace"))
    finally:
        for process in (sending, listening):
            if process.poll() is None:
                process.stop(5)


def summarize(runs: list[dict[str, Any]], block_kibs: list[int]) -> dict[str, Any]:
    by_block: dict[str, Any] = {}
    for block in block_kibs:
        reports = [run["report"] for run in runs if run["block_kib"] == block]
        medians = {
            key: round(statistics.median(r[key] for r in reports), 3)
            for key in FIGURES
            if reports and all(r.get(key) is not None for r in reports)
        }
        if "ucx_gbps" in medians and "socket_gbps" in medians:
            medians["ucx_vs_socket"] = round(medians["ucx_gbps"] / medians["socket_gbps"], 3)
        if "tcp_transport_gbps" in medians and "socket_gbps" in medians:
            medians["tcp_transport_vs_socket"] = round(
                medians["tcp_transport_gbps"] / medians["socket_gbps"], 3
            )
        by_block[f"{block}"] = {
            "median_of_runs": medians,
            "runs": {key: [r.get(key) for r in reports] for key in FIGURES},
            "ucx_lanes": sorted(
                {lane for r in reports for lane in (r.get("ucx_transports") or {}).get("lanes", [])}
            ),
            "ucx_tag_send": (reports[-1].get("ucx_transports") or {}).get("tag_send", {})
            if reports
            else {},
            "ucx_lanes_all_tcp": all(lanes_all_tcp(r) for r in reports) if reports else None,
            "bulk": sorted({(r.get("ucx_transports") or {}).get("bulk", "") for r in reports}),
        }
    return by_block


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"Cross-host `nori bench transfer` ({summary['cpu']['model_name']}, "
        f"{summary['cpu']['cpu_count']} CPUs): GB/s, median of {summary['runs_per_size']} runs "
        f"(each the median of {summary['repeats']} timed repeats), {summary['total_mib']} MiB "
        "per repeat, between two network namespaces over veth.",
        "",
        "| block | UCX | our TCP | plain socket | UCX / socket | memcpy | UCX lanes |",
        "|---|---|---|---|---|---|---|",
    ]
    for block, entry in summary["by_block_kib"].items():
        m = entry["median_of_runs"]
        lanes = "; ".join(entry["ucx_lanes"]) or "-"
        lines.append(
            f"| {block} KiB | {m.get('ucx_gbps', '-')} | {m.get('tcp_transport_gbps', '-')} | "
            f"{m.get('socket_gbps', '-')} | {m.get('ucx_vs_socket', '-')} | "
            f"{m.get('memcpy_gbps', '-')} | {lanes} |"
        )
    lines += ["", f"Load average (1, 5, 15 min) before and after: {summary['load_average']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nori.bench.cross_host_transfer")
    parser.add_argument("--out", default="results/transfer/cross-host", help="results folder")
    parser.add_argument("--block-kib", default="32,256", help="comma-separated block sizes")
    parser.add_argument("--runs", type=int, default=3, help="runs per block size")
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="ucx,tcp_transport,socket,memcpy")
    parser.add_argument("--destinations", choices=("scattered", "adjacent"), default="scattered")
    args = parser.parse_args(argv)
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"cross_host_transfer: {reason}", file=sys.stderr)
        return 2
    block_kibs = [int(part) for part in args.block_kib.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # The control connection's key (in the environment, not on a command line).
        "NORI_CLUSTER_SECRET": secrets.token_urlsafe(32),
    }
    loads = [load_average()]
    runs: list[dict[str, Any]] = []
    started = time.time()
    with Hosts(("sender", "receiver")) as hosts:
        for run in range(1, args.runs + 1):
            for block in block_kibs if run % 2 else list(reversed(block_kibs)):
                bench_args = _sender_args(args, str(block))
                name = f"run{run}-{block}kib"
                load_before = load_average()
                report = run_once(hosts, bench_args, log_dir, name, env)
                (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
                runs.append(
                    {
                        "run": run,
                        "block_kib": block,
                        "report": report,
                        "load_average_before": load_before,
                    }
                )
                print(
                    f"{name}: "
                    + ", ".join(f"{key} {report.get(key)}" for key in FIGURES)
                    + f", UCX lanes all TCP: {lanes_all_tcp(report)}, load {load_before}",
                    flush=True,
                )
        addresses = {name: host.address for name, host in hosts.hosts.items()}
    loads.append(load_average())
    summary = {
        "cpu": host_cpu(),
        "hosts": addresses,
        "driver_command": shlex.join(
            ["python", "-m", "nori.bench.cross_host_transfer", *(argv or sys.argv[1:])]
        ),
        "receiver_command": f"nori bench transfer --listen RECEIVER:{CONTROL_PORT}",
        "sender_command": shlex.join(
            [
                *("nori", "bench", "transfer", "--receiver", f"RECEIVER:{CONTROL_PORT}", "--json"),
                *_sender_args(args, "BLOCK_KIB"),
            ]
        ),
        "total_mib": args.total_mib,
        "repeats": args.repeats,
        "runs_per_size": args.runs,
        "wall_s": round(time.time() - started, 1),
        "load_average": loads,
        "by_block_kib": summarize(runs, block_kibs),
        "leftovers": hosts.leftovers(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def _sender_args(args: argparse.Namespace, block: str) -> list[str]:
    return [
        "--block-kib", block, "--total-mib", str(args.total_mib), "--repeats", str(args.repeats),
        "--transports", args.transports, "--destinations", args.destinations, "--bulk", "messages",
    ]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
