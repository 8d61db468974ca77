"""`nori bench compare --sweep --plot`: every side against the request rate (one line each:
colocated, disaggregated, conditional), so that the rate where disaggregation starts to pay (or
stops) shows as a crossing of the curves, and conditional disaggregation as a curve that should
follow the higher of the other two.

Two panels: effective throughput (each side's median over its runs), and the p99 inter-token
latency of the requests the comparison judges ITL by (the mixed dataset's short ones; each
side's median run). Drawn like `bench serve`'s plots:
matplotlib's object API on an Agg canvas, no pyplot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from nori.bench.compare_report import figure_of, sides_of


def plot_sweep(points: Sequence[Mapping[str, object]], path: str | Path) -> Path:
    """Writes the figure of a sweep's points (`compare_runs` reports with a request_rate)."""
    if not points:
        raise ValueError("plot_sweep needs at least one point")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    throughput_axes, itl_axes = figure.subplots(1, 2)
    rates = [float(str(point["request_rate"])) for point in points]
    request_class = str(points[0]["itl_p99_class"])
    for side in sides_of(points[0]):
        runs = [point[side] for point in points]
        throughputs = [_median_effective(point, side) for point in points]
        itls = [_value(run, "p99_itl_ms", request_class) for run in runs]
        throughput_axes.plot(rates, throughputs, marker="o", label=side)
        itl_axes.plot(rates, itls, marker="o", label=side)
    which = "" if request_class == "all" else f" ({request_class} requests)"
    throughput_axes.set(
        title="Effective throughput", xlabel="request rate (req/s)", ylabel="output tok/s"
    )
    itl_axes.set(
        title=f"P99 inter-token latency{which}", xlabel="request rate (req/s)", ylabel="ms"
    )
    for axes in (throughput_axes, itl_axes):
        axes.grid(True, alpha=0.3)
        axes.legend(loc="best")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target


def _value(run: object, name: str, request_class: str) -> float:
    """The figure, or NaN (a gap in the curve) when the run has none."""
    value = figure_of(run, name, request_class) if isinstance(run, Mapping) else None
    return float(value) if isinstance(value, int | float) else float("nan")


def _median_effective(point: Mapping[str, object], side: str) -> float:
    """The side's median effective throughput over its runs (a report from before those
    medians: its median run's), or NaN."""
    medians = point.get("effective_throughput_medians")
    if isinstance(medians, Mapping):
        value = medians.get(side)
        return float(value) if isinstance(value, int | float) else float("nan")
    return _value(point[side], "effective_throughput", "all")
