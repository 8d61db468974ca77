"""`nori bench transfer`: its arguments, and the run on one host or across two
(`--listen` on the receiving host, `--receiver` on the sending one)."""

from __future__ import annotations

import argparse
import json


def register_transfer(commands: argparse._SubParsersAction) -> None:
    transfer = commands.add_parser(
        "transfer", help="KV block transfer bandwidth: UCX vs our TCP, a plain socket, memcpy"
    )
    transfer.add_argument("--total-mib", type=int, default=64, help="bytes moved per repeat")
    transfer.add_argument(
        "--block-kib",
        type=int,
        default=32,
        help="size of one block message (default: one layer's K or V of one 16-token block of "
        "a Llama-3-8B-class model in bfloat16)",
    )
    transfer.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    transfer.add_argument(
        "--transports",
        default="ucx,tcp_transport,socket,memcpy",
        help="comma-separated subset of ucx,tcp_transport,socket,memcpy",
    )
    transfer.add_argument(
        "--destinations",
        choices=("scattered", "adjacent"),
        default="scattered",
        help="where the blocks land in the receiver's cache: scattered (no two consecutive "
        "blocks adjacent; blocks under 256 KiB still move in 1 MiB messages, landing through "
        "the receiver's staging buffer) or adjacent (runs of up to 1 MiB land in place)",
    )
    transfer.add_argument(
        "--bulk",
        choices=("mapped", "messages"),
        default="mapped",
        help="how our transports move the bytes between processes of one host: mapped (the "
        "receiver copies them out of its mapping of the sender's shared memory where it can, "
        "else messages; as the workers do) or messages (always sent as messages)",
    )
    transfer.add_argument(
        "--receiver",
        default=None,
        metavar="HOST:PORT",
        help="the receivers are on another host, served there by `nori bench transfer --listen "
        "HOST:PORT` (both sides need the same NORI_CLUSTER_SECRET); default: child processes "
        "on this host",
    )
    transfer.add_argument(
        "--listen",
        default=None,
        metavar="HOST:PORT",
        help="be the receiving side for a `--receiver HOST:PORT` run on another host: its "
        "receivers listen on HOST; it exits when that run is done (the other options come from "
        "the sender)",
    )
    transfer.add_argument("--json", action="store_true", help="print one JSON object")
    transfer.set_defaults(handler=run_transfer)


def run_transfer(args: argparse.Namespace) -> int:
    from nori.bench.transfer import run_transfer_benchmark
    from nori.bench.transfer_config import TransferBenchConfig
    from nori.bench.transfer_receivers import serve_receivers

    if args.listen is not None:
        if args.receiver is not None:
            raise ValueError("--listen and --receiver are the two sides: give one")
        serve_receivers(args.listen)
        return 0
    settings = TransferBenchConfig(
        total_mib=args.total_mib,
        block_kib=args.block_kib,
        repeats=args.repeats,
        transports=tuple(name.strip() for name in args.transports.split(",") if name.strip()),
        destinations=args.destinations,
        map_shared_memory=args.bulk == "mapped",
        receiver=args.receiver,
    )
    report = run_transfer_benchmark(settings)
    print_report(report, args.json)
    return 0


def print_report(report: dict[str, object], as_json: bool) -> None:
    """One JSON object, or one aligned `key: value` line per figure."""
    if as_json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>28}: {value}")
