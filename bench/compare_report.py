"""`nori bench compare`'s figures: each side's median run, the d/c ratios, the table.

Pure: it reads the JSON form of `bench serve` results (`ServeBenchResult.to_dict()`), so that it
is tested on fixed numbers.

- Each side's reported run is its median run by output throughput (the lower middle one of an
  even number of runs); every run stays in the JSON under "runs".
- `effective_throughput_ratio` and `itl_p99_ratio` are disaggregated / colocated of those runs.
  With the mixed dataset, `itl_p99_ratio` is that of the short requests: the interactive
  streams whose decoding a colocated server stalls with long prefills, which is what
  disaggregation protects (`itl_p99_class` says which; `itl_p99_ratio_all` pools every request).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

SIDES = ("colocated", "disaggregated")
MEDIAN_BY = "output_throughput"
# The mixed dataset's interactive requests.
SHORT_CLASS = "short"

Run = Mapping[str, object]


def median_index(values: Sequence[float]) -> int:
    """The index of the median value (the lower middle one of an even count)."""
    if not values:
        raise ValueError("no runs")
    order = sorted(range(len(values)), key=lambda index: values[index])
    return order[(len(order) - 1) // 2]


def ratio(disaggregated: object, colocated: object) -> float | None:
    """d / c, or None when either is missing or c is zero."""
    if not isinstance(disaggregated, int | float) or not isinstance(colocated, int | float):
        return None
    if colocated == 0 or math.isnan(colocated) or math.isnan(disaggregated):
        return None
    return float(disaggregated) / float(colocated)


def itl_class(run: Run) -> str:
    """ "short" when the run has the mixed dataset's short requests, else "all"."""
    return SHORT_CLASS if isinstance(run.get(SHORT_CLASS), Mapping) else "all"


def figure_of(run: Run, name: str, request_class: str = "all") -> object:
    """A figure of the run, or of one class of its requests."""
    if request_class == "all":
        return run.get(name)
    figures = run.get(request_class)
    return figures.get(name) if isinstance(figures, Mapping) else None


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def compare_runs(
    runs: Mapping[str, Sequence[Run]], request_rate: float | str | None = None
) -> dict[str, object]:
    """One comparison: the median run of each side, the ratios, and every run."""
    medians = {}
    for side in SIDES:
        side_runs = runs[side]
        index = median_index([_number(run.get(MEDIAN_BY)) for run in side_runs])
        medians[side] = {"run_index": index, **side_runs[index]}
    colocated, disaggregated = medians["colocated"], medians["disaggregated"]
    request_class = itl_class(colocated)
    report: dict[str, object] = {}
    if request_rate is not None:
        report["request_rate"] = request_rate
    report.update(
        {
            "median_by": MEDIAN_BY,
            "itl_p99_class": request_class,
            "colocated": colocated,
            "disaggregated": disaggregated,
            "itl_p99_ratio": ratio(
                figure_of(disaggregated, "p99_itl_ms", request_class),
                figure_of(colocated, "p99_itl_ms", request_class),
            ),
            "itl_p99_ratio_all": ratio(
                disaggregated.get("p99_itl_ms"), colocated.get("p99_itl_ms")
            ),
            "effective_throughput_ratio": ratio(
                disaggregated.get("effective_throughput"), colocated.get("effective_throughput")
            ),
            "output_throughput_ratio": ratio(
                disaggregated.get("output_throughput"), colocated.get("output_throughput")
            ),
            "runs": {side: [dict(run) for run in runs[side]] for side in SIDES},
        }
    )
    return report


# ------------------------------------------------------------------------------ tables

_ROWS = (
    ("Successful requests", "completed"),
    ("Failed requests", "failed"),
    ("Output throughput (tok/s)", "output_throughput"),
    ("Effective throughput (tok/s)", "effective_throughput"),
    ("Median TTFT (ms)", "median_ttft_ms"),
    ("P99 TTFT (ms)", "p99_ttft_ms"),
)


def format_comparison(report: Mapping[str, object]) -> str:
    """The two median runs side by side, their ratio, and every run's headline figure."""
    colocated = _mapping(report["colocated"])
    disaggregated = _mapping(report["disaggregated"])
    rows = [(label, name, "all") for label, name in _ROWS]
    request_class = str(report["itl_p99_class"])
    for cls in dict.fromkeys((request_class, "all")):
        rows.append((f"Median ITL, {cls} requests (ms)", "median_itl_ms", cls))
        rows.append((f"P99 ITL, {cls} requests (ms)", "p99_itl_ms", cls))
    lines = _header(report)
    lines.append(f"{'':<34}{'colocated':>14}{'disaggregated':>16}{'d/c':>8}")
    for label, name, cls in rows:
        c, d = figure_of(colocated, name, cls), figure_of(disaggregated, name, cls)
        lines.append(f"{label:<34}{_cell(c):>14}{_cell(d):>16}{_cell(ratio(d, c)):>8}")
    runs = _mapping(report["runs"])
    for side in SIDES:
        values = ", ".join(_cell(run.get(MEDIAN_BY)) for run in _runs(runs[side]))
        lines.append(f"{side} runs, output tok/s: {values}")
    return "\n".join(lines)


def _header(report: Mapping[str, object]) -> list[str]:
    """What the figures are of, when the report says (the command's top-level report does)."""
    if "cpus" not in report:
        return []
    rate = report.get("request_rate")
    at = f" at {_cell(rate)} req/s" if rate is not None else ""
    return [
        f"Colocated vs disaggregated on CPUs {report['cpus']}{at}: the median of "
        f"{report.get('repeats')} run(s) per side by output throughput"
    ]


def format_sweep(points: Sequence[Mapping[str, object]]) -> str:
    """One row per request rate: effective throughput and p99 ITL of both sides."""
    header = (
        f"{'rate (req/s)':>12}{'eff tok/s c':>13}{'eff tok/s d':>13}{'d/c':>7}"
        f"{'p99 ITL c':>12}{'p99 ITL d':>12}{'d/c':>7}"
    )
    lines = [header]
    for point in points:
        colocated, disaggregated = _mapping(point["colocated"]), _mapping(point["disaggregated"])
        request_class = str(point["itl_p99_class"])
        lines.append(
            f"{_cell(point.get('request_rate')):>12}"
            f"{_cell(colocated.get('effective_throughput')):>13}"
            f"{_cell(disaggregated.get('effective_throughput')):>13}"
            f"{_cell(point.get('effective_throughput_ratio')):>7}"
            f"{_cell(figure_of(colocated, 'p99_itl_ms', request_class)):>12}"
            f"{_cell(figure_of(disaggregated, 'p99_itl_ms', request_class)):>12}"
            f"{_cell(point.get('itl_p99_ratio')):>7}"
        )
    if points:
        which = str(points[0]["itl_p99_class"])
        lines.append(f"(ITL in ms, {which} requests; median run of each side by output tok/s)")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return "n/a" if value is None else str(value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _mapping(value: object) -> Mapping[str, object]:
    assert isinstance(value, Mapping)
    return value


def _runs(value: object) -> list[Mapping[str, object]]:
    assert isinstance(value, list)
    return [_mapping(run) for run in value]
