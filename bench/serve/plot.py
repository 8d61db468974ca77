"""Latency and throughput pictures of one run, or of several runs on the same axes.

One figure, three panels: the CDF of TTFT, the CDF of ITL, and output tokens per second over
the run (1 s bins). `plot_runs({"colocated": r1, "disaggregated": r2}, path)` draws two runs
side by side for comparison; `request_class="short"` keeps only the mixed dataset's short
requests, whose ITL is what disaggregation protects.

Drawn with matplotlib's object API on an Agg canvas: no pyplot, so no global figure state and
no display backend, whatever else the process has imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nori.bench.serve.figures import output_timeline
from nori.bench.serve.result import ServeBenchResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class RunCurves:
    """What the figure draws of one run."""

    ttfts_ms: tuple[float, ...]
    itls_ms: tuple[float, ...]
    tokens_per_s: tuple[float, ...]
    bin_s: float = 1.0

    @classmethod
    def from_result(
        cls, result: ServeBenchResult, request_class: str | None = None, bin_s: float = 1.0
    ) -> RunCurves:
        records = [
            r
            for r in result.records
            if r.success and (request_class is None or r.request_class == request_class)
        ]
        return cls(
            ttfts_ms=tuple(sorted(t * 1000.0 for r in records if (t := r.ttft) is not None)),
            itls_ms=tuple(sorted(gap * 1000.0 for r in records for gap in r.itls)),
            tokens_per_s=tuple(output_timeline(records, result.metrics.duration, bin_s)),
            bin_s=bin_s,
        )


def plot_runs(
    runs: Mapping[str, ServeBenchResult],
    path: str | Path,
    request_class: str | None = None,
) -> Path:
    """Writes the figure of the labelled runs to `path` (PNG, or any format matplotlib
    infers from the suffix) and returns the path."""
    if not runs:
        raise ValueError("plot_runs needs at least one run")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    ttft_axes, itl_axes, rate_axes = figure.subplots(1, 3)
    for label, result in runs.items():
        curves = RunCurves.from_result(result, request_class)
        _cdf(ttft_axes, curves.ttfts_ms, label)
        _cdf(itl_axes, curves.itls_ms, label)
        edges = [index * curves.bin_s for index in range(len(curves.tokens_per_s) + 1)]
        rate_axes.stairs(curves.tokens_per_s, edges, label=label)
    suffix = f" ({request_class} requests)" if request_class else ""
    ttft_axes.set(title=f"TTFT{suffix}", xlabel="ms", ylabel="fraction of requests")
    itl_axes.set(title=f"Inter-token latency{suffix}", xlabel="ms", ylabel="fraction of gaps")
    rate_axes.set(title=f"Output tokens/s{suffix}", xlabel="seconds into the run", ylabel="tok/s")
    for axes in (ttft_axes, itl_axes, rate_axes):
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="best")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target


def _cdf(axes: Axes, values: Sequence[float], label: str) -> None:
    if not values:
        return
    # Starts from 0 at the smallest value, so the curve has its first rise.
    fractions = [index / len(values) for index in range(len(values) + 1)]
    axes.step([values[0], *values], fractions, where="post", label=label)
