"""The client side of deploy/compose-check.sh: what it sends to a running `docker compose up`
stack from the host, and what it reads back (the gateway, Jaeger's query API, Prometheus).

    python deploy/compose_check.py SUBCOMMAND [options]   (--help for each)

Every subcommand prints what it found and exits 0 when the check passed, 1 when it did not.
It needs the `openai` and `httpx` packages (compose-check.sh runs it from a venv that has them).
The gateway's address, API key and model come from NORI_CHECK_BASE_URL (http://127.0.0.1:PORT),
NORI_CHECK_API_KEY and NORI_CHECK_MODEL (else the first of /v1/models).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from compose_streams import (
    API_KEY,
    BASE_URL,
    aclient,
    client,
    model_name,
    report_streams,
    run_streams,
    say,
)

# ------------------------------------------------------------------------------ gateway health


def cmd_wait_gateway(args: argparse.Namespace) -> int:
    """Waits until the gateway's /health is ok with at least --decode decode workers."""
    deadline = time.monotonic() + args.timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(BASE_URL + "/health", timeout=5)
            last = f"{r.status_code} {r.text.strip()[:200]}"
            body = r.json()
            workers = body.get("workers", {})
            if (
                r.status_code == 200
                and workers.get("decode", 0) == args.decode
                and workers.get("prefill", 0) >= 1
            ):
                say(f"gateway /health: {body['status']}, workers {workers}")
                return 0
        except (httpx.HTTPError, ValueError) as error:
            last = repr(error)
        time.sleep(1)
    say(f"gateway /health never showed {args.decode} decode worker(s): last {last}")
    return 1


# ------------------------------------------------------------------------------ requests


def cmd_requests(args: argparse.Namespace) -> int:
    """A completion, a streamed chat completion, and --concurrent completions at once."""
    model = model_name()
    say(f"model: {model}")
    c = client(timeout=120)
    t = time.monotonic()
    completion = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=16)
    text = completion.choices[0].text
    say(
        f"completion: {completion.usage.completion_tokens} tokens in {time.monotonic() - t:.2f} s,"
        f" finish_reason={completion.choices[0].finish_reason}: {text!r}"
    )
    if completion.usage.completion_tokens < 1:
        return 1

    t = time.monotonic()
    chunks, content = 0, []
    finish = None
    stream = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=24,
        stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            chunks += 1
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    say(
        f"streamed chat completion: {chunks} chunks in {time.monotonic() - t:.2f} s,"
        f" finish_reason={finish}: {''.join(content)!r}"
    )
    if chunks < 2 or finish is None:
        return 1

    async def many() -> list[Any]:
        ac = aclient(timeout=300)
        return await asyncio.gather(
            *(
                ac.completions.create(model=model, prompt=f"Request {i}:", max_tokens=16)
                for i in range(args.concurrent)
            ),
            return_exceptions=True,
        )

    t = time.monotonic()
    results = asyncio.run(many())
    failed = [r for r in results if isinstance(r, BaseException)]
    say(
        f"{args.concurrent} concurrent completions: {len(results) - len(failed)} succeeded,"
        f" {len(failed)} failed, in {time.monotonic() - t:.2f} s"
    )
    for error in failed[:3]:
        say(f"  failed: {error!r}")
    return 1 if failed else 0


# ------------------------------------------------------------------------------ traces


def cmd_trace(args: argparse.Namespace) -> int:
    """One request's spans, from the gateway, prefill and decode, under its x-trace-id."""
    model = model_name()
    raw = client(timeout=120).completions.with_raw_response.create(
        model=model, prompt="Tracing one request", max_tokens=8
    )
    trace_id = raw.headers.get("x-trace-id")
    raw.parse()
    if not trace_id:
        say("the response has no x-trace-id header")
        return 1
    say(f"trace id: {trace_id}")
    want = set(args.services)
    deadline = time.monotonic() + args.timeout
    services: set[str] = set()
    spans: list[tuple[int, str, str]] = []
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{args.jaeger}/api/traces/{trace_id}", timeout=5)
            if r.status_code == 200:
                data = r.json()["data"][0]
                processes = data["processes"]
                spans = sorted(
                    (s["startTime"], s["operationName"], processes[s["processID"]]["serviceName"])
                    for s in data["spans"]
                )
                services = {service for _, _, service in spans}
                if want <= services:
                    break
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(1)
    say(f"{len(spans)} spans from {sorted(services)} at {args.jaeger}/api/traces/{trace_id}:")
    for _, name, service in spans:
        say(f"  {service:<14} {name}")
    missing = want - services
    if missing:
        say(f"no spans from {sorted(missing)}")
        return 1
    return 0


# ------------------------------------------------------------------------------ Prometheus


def cmd_targets(args: argparse.Namespace) -> int:
    """Every replica among Prometheus' scrape targets, all up: JOB=COUNT for each job."""
    want = {job: int(n) for job, n in (spec.split("=") for spec in args.expect)}
    deadline = time.monotonic() + args.timeout
    targets: list[dict[str, Any]] = []
    ok = False
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{args.prometheus}/api/v1/targets", timeout=5)
            targets = r.json()["data"]["activeTargets"]
        except (httpx.HTTPError, ValueError, KeyError):
            targets = []
        up = {}
        for t in targets:
            if t["health"] == "up":
                up[t["labels"]["job"]] = up.get(t["labels"]["job"], 0) + 1
        counts = {job: sum(1 for t in targets if t["labels"]["job"] == job) for job in want}
        if all(up.get(job, 0) == n and counts[job] == n for job, n in want.items()):
            ok = True
            break
        time.sleep(2)
    for t in sorted(targets, key=lambda t: (t["labels"]["job"], t["labels"]["instance"])):
        say(
            f"  {t['labels']['job']:<16} {t['labels']['instance']:<24} {t['health']:<8}"
            f" {t.get('lastError') or ''}"
        )
    if not ok:
        say(f"expected, all up: {want}")
    return 0 if ok else 1


def cmd_migration(args: argparse.Namespace) -> int:
    """--streams long streams; once all stream, `docker kill` of the busiest of the --kill
    containers (the decode replicas): every stream must complete."""
    killed: dict[str, Any] = {}

    def kill() -> None:
        stats = subprocess.run(
            ["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.CPUPerc}}", *args.kill],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        cpu = {
            line.split()[0]: float(line.split()[1].rstrip("%")) for line in stats if line.strip()
        }
        victim = max(cpu, key=cpu.__getitem__)
        killed["at"] = time.time()
        subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
        killed["name"] = victim
        say(f"CPU use of the decode replicas: {cpu}; docker kill {victim} (every stream running)")

    results, wall, _ = run_streams(args.streams, args.max_tokens, during=kill, after_first=1.0)
    complete = report_streams(results, args.max_tokens)
    say(f"wall time {wall:.1f} s")
    if args.gateway and killed:
        logs = subprocess.run(
            ["docker", "logs", "--since", str(int(killed["at"]) - 1), args.gateway],
            capture_output=True,
            text=True,
        )
        moved = (logs.stdout + logs.stderr).count("continuing on another decode worker")
        say(f"the gateway's log: {moved} stream(s) continued on another decode worker")
        if moved == 0:
            say("no stream moved: migration was not exercised")
            return 1
    return 0 if complete == args.streams else 1


def cmd_drain(args: argparse.Namespace) -> int:
    """--streams long streams; `--stop` (compose stop) once all stream; a request sent while
    the gateway drains must get 503 with Retry-After; every stream must complete."""
    proc: dict[str, Any] = {}

    def stop_and_probe() -> dict[str, Any]:
        t = time.monotonic()
        p = subprocess.Popen(
            args.stop, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        proc["p"] = p

        def wait() -> None:
            proc["out"] = p.communicate()[0]
            proc["took"] = time.monotonic() - t

        threading.Thread(target=wait, daemon=True).start()
        say(f"{time.strftime('%H:%M:%S')} started: {args.stop}")
        # The gateway drains once /health answers the drain's 503 (the server is shutting
        # down; a 503 for want of workers, who drain too, is not it): then a new request.
        probe: dict[str, Any] = {"status": None, "error": "the gateway never said it drained"}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(BASE_URL + "/health", timeout=5)
                if health.status_code == 503 and "shutting down" in health.text:
                    r = httpx.post(
                        BASE_URL + "/v1/completions",
                        headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": args.model, "prompt": "after the stop", "max_tokens": 4},
                        timeout=30,
                    )
                    probe = {
                        "status": r.status_code,
                        "retry_after": r.headers.get("retry-after"),
                        "body": r.text[:200],
                        "sent_s_after_stop": round(time.monotonic() - t, 2),
                    }
                    break
            except httpx.HTTPError as error:
                probe = {"status": None, "error": repr(error), "after_s": time.monotonic() - t}
                break
            time.sleep(0.1)
        return probe

    args.model = model_name()
    results, _wall, probe = run_streams(
        args.streams, args.max_tokens, during=stop_and_probe, after_first=1.0
    )
    complete = report_streams(results, args.max_tokens)
    proc["p"].wait(timeout=600)
    time.sleep(0.2)
    say(
        f"the stop command exited {proc['p'].returncode}, {proc.get('took', 0):.1f} s after it began"
    )
    for line in proc.get("out", "").splitlines():
        if "done" in line or "rror" in line:
            say(f"  | {line.strip()}")
    say(f"a request sent while the gateway drained: {json.dumps(probe)}")
    ok_probe = probe.get("status") == 503 and bool(probe.get("retry_after"))
    if not ok_probe:
        say("expected HTTP 503 with a Retry-After header")
    return 0 if complete == args.streams and ok_probe else 1


def cmd_streams(args: argparse.Namespace) -> int:
    """--runs rounds of --streams streams of --max-tokens: the wall time of each, the median."""
    walls = []
    for run in range(args.runs):
        results, wall, _ = run_streams(args.streams, args.max_tokens)
        complete = sum(1 for r in results if r.error is None and r.tokens == args.max_tokens)
        say(f"  run {run + 1}: {complete}/{args.streams} complete in {wall:.1f} s")
        if complete != args.streams:
            report_streams(results, args.max_tokens)
            return 1
        walls.append(wall)
    median = statistics.median(walls)
    say(f"median wall time {median:.1f} s of {args.runs} run(s)")
    if args.out:
        with open(args.out, "w") as out:
            out.write(f"{median:.1f}\n")
    return 0


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("wait-gateway", help=cmd_wait_gateway.__doc__)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300)
    p.set_defaults(func=cmd_wait_gateway)

    p = sub.add_parser("requests", help=cmd_requests.__doc__)
    p.add_argument("--concurrent", type=int, default=20)
    p.set_defaults(func=cmd_requests)

    p = sub.add_parser("trace", help=cmd_trace.__doc__)
    p.add_argument("--jaeger", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--services", nargs="+", default=["nori-gateway", "nori-prefill", "nori-decode"])
    p.add_argument("--timeout", type=float, default=60)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("targets", help=cmd_targets.__doc__)
    p.add_argument("--prometheus", required=True, help="http://127.0.0.1:PORT")
    p.add_argument("--expect", nargs="+", required=True, help="JOB=COUNT ...")
    p.add_argument("--timeout", type=float, default=90)
    p.set_defaults(func=cmd_targets)

    for name, func in (
        ("migration", cmd_migration),
        ("drain", cmd_drain),
        ("streams", cmd_streams),
    ):
        p = sub.add_parser(name, help=func.__doc__)
        p.add_argument("--streams", type=int, default=8)
        p.add_argument("--max-tokens", type=int, default=1000)
        p.set_defaults(func=func)
    sub.choices["migration"].add_argument(
        "--kill", nargs="+", required=True, help="decode containers"
    )
    sub.choices["migration"].add_argument(
        "--gateway", default=None, help="its log counts migrations"
    )
    sub.choices["drain"].add_argument("--stop", required=True, help="the stop command (shell)")
    sub.choices["streams"].add_argument("--runs", type=int, default=1)
    sub.choices["streams"].add_argument("--out", default=None, help="a file for the median")

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
