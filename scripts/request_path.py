"""Lists the source files one request passes through, across every process of a local cluster.

Starts `nori up` (the demo model; `--colocated` for one worker) with a profiler in each of its
Python processes (a `sitecustomize` on PYTHONPATH: the gateway, the workers, their engine
processes), sends warm-up requests, then measures three windows of the same length: idle, one
`POST /v1/completions`, idle again. A file is on the request's path when the request window
called its functions more often than either idle window; calls made by the cluster's periodic
tasks (`BACKGROUND_TASKS`: heartbeats, the load log, registry reads) are not counted in any
window, since their share of a window varies with when they fire. Generated gRPC stubs
(`*_pb2*.py`) are left out, as in the product's line count. Prints the files in the order the
request first entered them, with their line counts, and the totals: all of them, and without
the model's forward pass and sampling (the serving path proper).

Usage: python scripts/request_path.py [--colocated] [--stream] [--json FILE]
"""

from __future__ import annotations

import argparse
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
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The model's forward pass and sampling: the same for a request however it is served.
MODEL_FORWARD = ("shared/models/", "shared/kernels/", "shared/sampling/")

# The cluster's periodic tasks, whose calls are not the request's whatever window they fall in:
# the workers' heartbeat and load log, the gateway's registry reads.
BACKGROUND_TASKS = (
    "Heartbeat._run",
    "Worker._log_load_forever",
    "WorkerPool._refresh_forever",
)

# Installed in every Python process of the cluster. SIGUSR1 starts a window; the next SIGUSR1
# writes what the window called (file -> calls, and the order files were first entered).
SITECUSTOMIZE = """
import os, sys, signal, threading, json, itertools
_dir = os.environ.get("NORI_PATH_TRACE_DIR")
if _dir:
    _root = os.environ["NORI_PATH_TRACE_ROOT"]
    _venv = os.path.join(_root, ".venv")
    _background = frozenset(os.environ["NORI_PATH_TRACE_BACKGROUND"].split(","))
    _state = {"on": False, "calls": {}, "first": {}, "window": 0}
    _tick = itertools.count()
    def _in_background(frame):
        while frame is not None:
            if frame.f_code.co_qualname in _background:
                return True
            frame = frame.f_back
        return False
    def _profile(frame, event, arg):
        if event != "call" or not _state["on"]:
            return
        name = frame.f_code.co_filename
        if name.startswith(_root) and not name.startswith(_venv) and not _in_background(frame):
            calls = _state["calls"]
            if name not in calls:
                calls[name] = 0
                _state["first"][name] = next(_tick)
            calls[name] += 1
    def _toggle(signum, frame):
        if _state["on"]:
            _state["on"] = False
            path = os.path.join(_dir, "%d.%d.json" % (os.getpid(), _state["window"]))
            with open(path, "w") as out:
                json.dump({"calls": _state["calls"], "first": _state["first"]}, out)
            _state["window"] += 1
        else:
            _state["calls"], _state["first"] = {}, {}
            _state["on"] = True
    try:
        signal.signal(signal.SIGUSR1, _toggle)
        open(os.path.join(_dir, "pid.%d" % os.getpid()), "w").close()
        sys.setprofile(_profile)
        threading.setprofile(_profile)
    except ValueError:
        pass
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read().decode()
    if raw.startswith("data:"):
        return {"events": raw.count("data:")}
    return dict(json.loads(raw))


def toggle_all(trace_dir: Path) -> None:
    for marker in trace_dir.glob("pid.*"):
        pid = int(marker.name.split(".")[1])
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            marker.unlink()


def window_counts(trace_dir: Path, window: int) -> tuple[Counter[str], dict[str, float]]:
    calls: Counter[str] = Counter()
    first: dict[str, float] = {}
    for path in trace_dir.glob(f"*.{window}.json"):
        record = json.loads(path.read_text())
        calls.update(record["calls"])
        span = max(record["first"].values(), default=0) + 1
        for name, tick in record["first"].items():
            # Processes are not ordered against each other; within each, the first call orders.
            first[name] = min(first.get(name, 1e9), tick / span)
    return calls, first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()

    trace_dir = Path(tempfile.mkdtemp(prefix="nori-path-"))
    site_dir = trace_dir / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site_dir), env.get("PYTHONPATH")]))
    env["NORI_PATH_TRACE_DIR"] = str(trace_dir)
    env["NORI_PATH_TRACE_ROOT"] = str(ROOT) + os.sep
    env["NORI_PATH_TRACE_BACKGROUND"] = ",".join(BACKGROUND_TASKS)
    command = [
        str(ROOT / ".venv/bin/nori"),
        "up",
        "--port",
        str(port),
        "--namespace",
        f"path{port}",
    ]
    disaggregated = ["--prefill", "1", "--decode", "1", "--disaggregation", "always"]
    command += ["--colocated"] if args.colocated else disaggregated
    log = open(trace_dir / "up.log", "w")  # noqa: SIM115 (open for the cluster's lifetime)
    cluster = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                model = http(f"{base}/v1/models", timeout=5)["data"][0]["id"]
                break
            except OSError:
                if cluster.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"nori up did not serve; see {trace_dir / 'up.log'}") from None
                time.sleep(1)
        body = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 16,
            "stream": args.stream,
        }
        warmed = 0
        while warmed < 2:  # the workers register a little after the gateway serves
            try:
                http(f"{base}/v1/completions", body)
                warmed += 1
            except urllib.error.HTTPError as error:
                if error.code not in (429, 503) or time.monotonic() > deadline:
                    raise
                time.sleep(1)
        time.sleep(3)
        window_s = 4.0
        toggle_all(trace_dir)  # window 0: idle
        time.sleep(window_s)
        toggle_all(trace_dir)
        time.sleep(1)
        toggle_all(trace_dir)  # window 1: one request
        started = time.monotonic()
        http(f"{base}/v1/completions", body)
        time.sleep(max(0.0, window_s - (time.monotonic() - started)))
        toggle_all(trace_dir)
        time.sleep(1)
        toggle_all(trace_dir)  # window 2: idle again
        time.sleep(window_s)
        toggle_all(trace_dir)
        time.sleep(2)
    finally:
        cluster.send_signal(signal.SIGTERM)
        try:
            cluster.wait(timeout=60)
        except subprocess.TimeoutExpired:
            cluster.kill()
    idle = window_counts(trace_dir, 0)[0] | window_counts(trace_dir, 2)[0]  # the larger count
    busy, first = window_counts(trace_dir, 1)
    on_path = sorted(
        (name for name in busy if busy[name] > idle.get(name, 0) and "_pb2" not in name),
        key=first.get,
    )
    rows = []
    for name in on_path:
        lines = len(Path(name).read_text().splitlines())
        rows.append({"file": os.path.relpath(name, ROOT), "lines": lines})
        print(f"{lines:6d}  {rows[-1]['file']}")
    total = sum(row["lines"] for row in rows)
    serving = [row for row in rows if not row["file"].startswith(MODEL_FORWARD)]
    serving_lines = sum(row["lines"] for row in serving)
    mode = "colocated" if args.colocated else "disaggregated"
    print(f"{len(rows)} files, {total} lines ({mode})")
    print(
        f"without the model's forward ({', '.join(MODEL_FORWARD)}): "
        f"{len(serving)} files, {serving_lines} lines"
    )
    if args.json:
        result = {
            "mode": mode,
            "files": rows,
            "total_lines": total,
            "serving_files": len(serving),
            "serving_lines": serving_lines,
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
