"""`nori run-batch -i IN -o OUT`: an OpenAI batch file through a whole cluster, as vLLM's
`run-batch` takes it, with resume and the throughput the job reached.

`--url` sends the lines to a running gateway, else `--model` (and `nori up`'s flags) starts a
local cluster. Lines go at the batch priority, `--max-in-flight` at once; each result is fsync'd
as it comes, so `--resume` after an interruption runs only the `custom_id`s the output lacks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nori.cli.progress import add_progress_arg, show_progress

# The most lines `nori run-batch` takes in one file (docs/serving.md, "Batch jobs").
MAX_RUN_BATCH_LINES = 10_000_000


def register(subparsers: argparse._SubParsersAction) -> None:
    from nori.cli.up import add_up_args

    parser = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through a cluster: a running one (--url) or "
        "one started for the job (--model)",
    )
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    parser.add_argument(
        "-o", "--output-file", required=True, help="results, one JSON line per custom_id"
    )
    parser.add_argument(
        "--url",
        default=None,
        metavar="GATEWAY",
        help="a running gateway, e.g. http://127.0.0.1:8000 (default: start a local cluster "
        "from --model and the cluster flags below)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the output's results and run only the custom_ids it lacks",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=512,
        help="lines sent at once (the gateway queues what its pools cannot start yet)",
    )
    parser.add_argument(
        "--summary-json", default=None, metavar="FILE", help="also write the figures as JSON"
    )
    add_progress_arg(parser)
    add_up_args(parser)
    parser.set_defaults(handler=run)


@dataclass
class JobFigures:
    """What the job reached; `summary` prints it."""

    num_lines: int = 0
    num_done: int = 0
    num_failed: int = 0
    num_skipped: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    effective_output_tokens: int = 0
    # Output tokens per second of each successful line, over its whole time in flight.
    speeds: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        wall = max(self.wall_s, 1e-9)
        speeds = sorted(self.speeds)
        return {
            "lines": self.num_lines,
            "done": self.num_done,
            "failed": self.num_failed,
            "skipped_resumed": self.num_skipped,
            "retries": self.retries,
            "wall_s": round(self.wall_s, 3),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "request_decode_tok_s_median": round(statistics.median(speeds), 2) if speeds else None,
            "request_decode_tok_s_p10": (
                round(speeds[int(0.1 * (len(speeds) - 1))], 2) if speeds else None
            ),
            "output_tok_s": round(self.output_tokens / wall, 2),
            "total_tok_s": round((self.prompt_tokens + self.output_tokens) / wall, 2),
            "effective_output_tok_s": round(self.effective_output_tokens / wall, 2),
        }

    def summary(self) -> str:
        d = self.as_dict()
        return "\n".join(
            [
                f"lines: {d['done']} done, {d['failed']} failed, {d['skipped_resumed']} kept "
                f"from the output ({d['lines']} in the input); {d['retries']} retries",
                f"wall time: {d['wall_s']:.1f} s",
                f"per-request decode speed: median {d['request_decode_tok_s_median']} tok/s, "
                f"p10 {d['request_decode_tok_s_p10']} tok/s",
                f"system throughput: {d['output_tok_s']} output tok/s, "
                f"{d['total_tok_s']} total tok/s",
                f"effective throughput: {d['effective_output_tok_s']} output tok/s (lines "
                "that finished without error and were not cut short by a limit they did not set)",
            ]
        )


def done_custom_ids(output: Path) -> set[str]:
    """The custom_ids the output already holds (a torn last line, from a crash, is not one)."""
    done: set[str] = set()
    if not output.exists():
        return done
    with output.open("rb") as lines:
        for raw in lines:
            with contextlib.suppress(ValueError, AttributeError):
                custom_id = json.loads(raw).get("custom_id")
                if isinstance(custom_id, str):
                    done.add(custom_id)
    return done


def run(args: argparse.Namespace) -> int:
    from nori.batch.input_file import check_input

    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be at least 1, got {args.max_in_flight}")
    source = Path(args.input_file)
    if not source.is_file():
        raise ValueError(f"--input-file {source}: no such file")
    output = Path(args.output_file)
    if output.exists() and output.stat().st_size > 0 and not args.resume:
        raise ValueError(
            f"--output-file {output} exists: --resume continues it, or remove it to start over"
        )
    checked = check_input(source, None, MAX_RUN_BATCH_LINES)
    if checked.batch_errors:
        raise ValueError(f"{source}: {checked.batch_errors[0]['message']}")
    if args.url is not None:
        return _run_job(args, checked, source, output, args.url, None)
    from nori.cli.up import prepare_cluster
    from nori.launch.local_cluster import LocalCluster, free_port

    args.batch_runners = 0  # the job's lines come from here, not from the Batch API
    args.port = free_port()
    spec, redis_server = prepare_cluster(args)
    cluster = LocalCluster(spec)
    try:
        print(f"nori: starting a local cluster for {spec.served_model_name!r}...", file=sys.stderr)
        cluster.start(timeout_s=args.startup_timeout_s)
        return _run_job(args, checked, source, output, cluster.url, spec.api_key)
    finally:
        cluster.stop()
        if redis_server is not None:
            redis_server.stop()


def _run_job(
    args: argparse.Namespace,
    checked: Any,
    source: Path,
    output: Path,
    url: str,
    api_key: str | None,
) -> int:
    from nori.settings import Environment

    figures = JobFigures(num_lines=checked.total)
    key = api_key or args.api_key or Environment.read().api_key
    interrupted = asyncio.run(_run_lines(args, checked, source, output, url, key, figures))
    print(figures.summary(), file=sys.stderr)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(figures.as_dict(), indent=2) + "\n")
    if interrupted:
        print(
            f"nori: interrupted; {output} holds every result so far (--resume continues)",
            file=sys.stderr,
        )
        return 130
    return 0 if figures.num_failed == 0 else 1


async def _run_lines(
    args: argparse.Namespace,
    checked: Any,
    source: Path,
    output: Path,
    url: str,
    api_key: str | None,
    figures: JobFigures,
) -> bool:
    """Every line not in the output yet; True when stopped by Ctrl-C or SIGTERM."""
    import aiohttp
    from tqdm import tqdm

    from nori.batch.durable_writes import AppendLog
    from nori.batch.line_client import LineOutcome, error_record, send_line

    done = done_custom_ids(output) if args.resume else set()
    log = AppendLog(output)
    for error in checked.line_errors:
        if error["custom_id"] is None or error["custom_id"] not in done:
            record = error_record(
                f"batch_req_line_{error['line']}",
                error["custom_id"],
                error["code"],
                error["message"],
            )
            await log.append(json.dumps(record).encode())
            figures.num_failed += 1
    todo = [line for line in checked.lines if line.custom_id not in done]
    figures.num_skipped = len(checked.lines) - len(todo)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    bar = tqdm(total=len(todo), unit="line", disable=not show_progress(args), dynamic_ncols=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    job = secrets.token_hex(4)  # request ids unique across jobs on one gateway

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        line = todo[index]
        with source.open("rb") as reader:
            reader.seek(line.offset)
            entry = json.loads(reader.read(line.length))
        outcome: LineOutcome = await send_line(
            session,
            url.rstrip("/") + entry["url"],
            entry["body"],
            record_id=f"batch_req_line_{line.line}",
            custom_id=line.custom_id,
            request_id=f"run-batch-{job}-{line.line}",
            deadline=float("inf"),
        )
        await log.append(json.dumps(outcome.record).encode())
        figures.retries += outcome.retries
        if outcome.ok:
            figures.num_done += 1
            figures.prompt_tokens += outcome.prompt_tokens
            figures.output_tokens += outcome.completion_tokens
            if outcome.effective:
                figures.effective_output_tokens += outcome.completion_tokens
            if outcome.latency_s > 0:
                figures.speeds.append(outcome.completion_tokens / outcome.latency_s)
        else:
            figures.num_failed += 1
        elapsed = max(time.monotonic() - started, 1e-9)
        bar.set_postfix_str(f"{figures.output_tokens / elapsed:.0f} tok/s", refresh=False)
        bar.update(1)

    connector = aiohttp.TCPConnector(limit=args.max_in_flight)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    next_index = iter(range(len(todo)))

    async def sender(session: aiohttp.ClientSession) -> None:
        for index in next_index:
            if stop.is_set():
                return
            await one(session, index)

    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        senders = [
            asyncio.create_task(sender(session)) for _ in range(min(args.max_in_flight, len(todo)))
        ]
        stopper = asyncio.create_task(stop.wait())
        all_sent: asyncio.Future[Any] = asyncio.gather(*senders)
        await asyncio.wait([all_sent, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in senders:
            task.cancel()  # Ctrl-C: the lines in flight are dropped (their calls close)
        await asyncio.gather(*senders, return_exceptions=True)
        stopper.cancel()
    figures.wall_s = time.monotonic() - started
    bar.close()
    log.close()
    return stop.is_set()
