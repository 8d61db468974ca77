"""Where an interactive request's time to first token goes, from the spans `otlp_sink --spans`
recorded during `nori.bench.batch_interactive` (issue 23):

    python -m nori.bench.otlp_sink --port 4399 --spans spans.jsonl &
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:4399 \\
        python -m nori.bench.batch_interactive --out DIR
    python -m nori.bench.trace_phases spans.jsonl

Interactive requests are the completions traces without a "batch line" span; each is counted
alone or beside the batch by whether a batch line was in flight when it started. Phases: the
gateway's admission (request start to "route"), the decode worker's reservation ("reserve"),
the wait before the prefill worker's span, that worker's queue and compute (the step that
computed the prompt), and the KV send.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

Span = dict[str, Any]
PHASES = ("admit", "reserve", "to_prefill", "prefill_queue", "prefill_compute", "kv_send")


def _seconds(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e9


def _phases(spans: list[Span]) -> dict[str, float] | None:
    named = {(span["service"], span["name"]): span for span in spans}
    root = named.get(("nori-gateway", "POST /v1/completions"))
    route = named.get(("nori-gateway", "route"))
    reserve = named.get(("nori-gateway", "reserve"))
    prefill = named.get(("nori-prefill", "prefill"))
    queue = named.get(("nori-prefill", "queue"))
    compute = named.get(("nori-prefill", "compute"))
    send = named.get(("nori-prefill", "kv_send"))
    if not (root and route and reserve and prefill and queue and compute):
        return None
    return {
        "start_ns": root["start_ns"],
        "admit": _seconds(root["start_ns"], route["start_ns"]),
        "reserve": _seconds(reserve["start_ns"], reserve["end_ns"]),
        "to_prefill": _seconds(reserve["end_ns"], prefill["start_ns"]),
        "prefill_queue": _seconds(queue["start_ns"], queue["end_ns"]),
        "prefill_compute": _seconds(compute["start_ns"], compute["end_ns"]),
        "kv_send": _seconds(send["start_ns"], send["end_ns"]) if send else 0.0,
        "prompt_tokens": compute["attributes"].get("nori.prompt_tokens", 0),
    }


def summarize(spans: list[Span]) -> dict[str, dict[str, Any]]:
    traces: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        traces[span["trace"]].append(span)
    lines = sorted(
        (span["start_ns"], span["end_ns"]) for span in spans if span["name"] == "batch line"
    )
    starts = [start for start, _ in lines]
    latest_end: list[int] = []  # the latest end among the lines started so far
    for _, end in lines:
        latest_end.append(max(end, latest_end[-1]) if latest_end else end)

    def beside_batch(at_ns: int) -> bool:
        index = bisect.bisect_right(starts, at_ns) - 1
        return index >= 0 and latest_end[index] >= at_ns

    groups: dict[str, list[dict[str, float]]] = {"alone": [], "beside batch": []}
    for trace_spans in traces.values():
        if any(span["name"] == "batch line" for span in trace_spans):
            continue
        phases = _phases(trace_spans)
        if phases is not None:
            groups["beside batch" if beside_batch(int(phases["start_ns"])) else "alone"].append(
                phases
            )
    summary: dict[str, dict[str, Any]] = {}
    for group, rows in groups.items():
        figures: dict[str, Any] = {"requests": len(rows)}
        for phase in (*PHASES, "prompt_tokens"):
            values = sorted(row[phase] for row in rows)
            if values:
                figures[phase] = {
                    "p50": values[len(values) // 2],
                    "p90": values[int(len(values) * 0.9)],
                    "max": values[-1],
                }
        summary[group] = figures
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spans", type=Path, help="the JSON-lines file of otlp_sink --spans")
    args = parser.parse_args(argv)
    with args.spans.open() as lines:
        spans = [json.loads(line) for line in lines]
    for group, figures in summarize(spans).items():
        print(f"{group}: {figures['requests']} requests")
        for phase in (*PHASES, "prompt_tokens"):
            if phase in figures:
                p = figures[phase]
                print(
                    f"  {phase:16s} p50 {p['p50']:8.3f}  p90 {p['p90']:8.3f}  max {p['max']:8.3f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
