"""`nori bench compare`'s figures: each side's median run, the ratios, the winner, the tables.

Pure: it reads the JSON form of `bench serve` results (`ServeBenchResult.to_dict()`), so that it
is tested on fixed numbers.

- The sides (`SIDES`, in the order they run): "colocated" (`nori up --colocated`),
  "disaggregated" (`nori up`, every prompt on a prefill worker: `--disaggregation always`) and
  "conditional" (the same workers, the gateway choosing per request: `--disaggregation auto`).
  A comparison holds two or three of them.
- Each side's reported run is its median run by output throughput (the lower middle one of an
  even number of runs); every run stays in the JSON under "runs".
- Effective throughput (tok/s of requests that met the SLOs) is judged over every run, not the
  median run: `effective_throughput_medians` holds each side's median over its runs (the lower
  middle one of an even count), and `rounds_led` how many rounds (the i-th run of every side,
  run in alternation) each side led. The winner and the conditional side's ratio below are of
  these medians: a median run chosen by output tok/s may be another round's than the one
  with the median effective tok/s, so its figures could pair different rounds.
- `ratios` holds each side's figures over the colocated side's (`effective_throughput_ratio`,
  `output_throughput_ratio`, `itl_p99_ratio`, `itl_p99_ratio_all`); the flat keys of the same
  names are the disaggregated side's, as before the third side came. With the mixed dataset,
  `itl_p99_ratio` is that of the short requests: the interactive streams whose decoding a
  colocated server stalls with long prefills, which is what disaggregation protects
  (`itl_p99_class` says which; `itl_p99_ratio_all` pools every request).
- The conditional side is also judged against the better of the other two, figure by figure
  (`conditional_vs_best_effective_throughput`: its median effective tok/s over the higher of
  theirs; `conditional_vs_best_itl_p99`: its median run's p99 ITL over the lower of theirs):
  above 1.0 in throughput (below in ITL), choosing per request beats both fixed policies.
- `winner`: the side with the highest median effective throughput (None when no side has any).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

Side = Literal["colocated", "disaggregated", "conditional"]
SIDES: tuple[Side, ...] = get_args(Side)
# The column letters of the tables.
SIDE_LETTERS: Mapping[Side, str] = {"colocated": "c", "disaggregated": "d", "conditional": "a"}
BASELINE: Side = "colocated"
MEDIAN_BY = "output_throughput"
WINNER_BY = "effective_throughput"
# The mixed dataset's interactive requests.
SHORT_CLASS = "short"
# The figures each side is compared by: (report key, figure name, judged on the ITL class).
_RATIOS = (
    ("itl_p99_ratio", "p99_itl_ms", True),
    ("itl_p99_ratio_all", "p99_itl_ms", False),
    ("effective_throughput_ratio", "effective_throughput", False),
    ("output_throughput_ratio", "output_throughput", False),
)

Run = Mapping[str, object]


def parse_sides(text: str) -> tuple[Side, ...]:
    """--sides "colocated,conditional" -> the sides, in the order they run."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in SIDES]
    if unknown:
        raise ValueError(f"--sides: unknown side {unknown[0]!r} (choose from {', '.join(SIDES)})")
    return check_sides(tuple(side for side in SIDES if side in names))


def check_sides(sides: Sequence[str]) -> tuple[Side, ...]:
    """Two or three distinct known sides, in `SIDES` order."""
    if len(set(sides)) < 2 or not set(sides) <= set(SIDES):
        raise ValueError(f"--sides needs two or three of {', '.join(SIDES)}")
    return tuple(side for side in SIDES if side in sides)


def median_index(values: Sequence[float]) -> int:
    """The index of the median value (the lower middle one of an even count)."""
    if not values:
        raise ValueError("no runs")
    order = sorted(range(len(values)), key=lambda index: values[index])
    return order[(len(order) - 1) // 2]


def ratio(numerator: object, denominator: object) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is zero."""
    if not isinstance(numerator, int | float) or not isinstance(denominator, int | float):
        return None
    if denominator == 0 or math.isnan(denominator) or math.isnan(numerator):
        return None
    return float(numerator) / float(denominator)


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


def _known(value: object) -> float | None:
    """A figure that can be compared: a number, not NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def ratios_against(side: Run, baseline: Run, request_class: str) -> dict[str, float | None]:
    """The side's figures over the baseline's (`_RATIOS`)."""
    return {
        key: ratio(
            figure_of(side, name, request_class if on_class else "all"),
            figure_of(baseline, name, request_class if on_class else "all"),
        )
        for key, name, on_class in _RATIOS
    }


def best_of(
    figures: Mapping[str, object], sides: Sequence[str], higher: bool
) -> tuple[str | None, float | None]:
    """The side whose figure is best (the highest, or the lowest), and that figure; the first
    in `sides` order on a tie; (None, None) when no side has the figure."""
    best: tuple[str | None, float | None] = (None, None)
    for side in sides:
        value = _known(figures[side])
        if value is None:
            continue
        if best[1] is None or (value > best[1] if higher else value < best[1]):
            best = (side, value)
    return best


def median_figure(side_runs: Sequence[Run], name: str) -> float | None:
    """The median of a figure over a side's runs (the lower middle one of an even count), or
    None when no run has it."""
    values = [value for run in side_runs if (value := _known(run.get(name))) is not None]
    return statistics.median_low(values) if values else None


def rounds_led(runs: Mapping[str, Sequence[Run]], sides: Sequence[str]) -> dict[str, int]:
    """Per side, the rounds (the i-th run of every side) in which its effective throughput was
    the highest (the first in `sides` order on a tie; a round where no side has one counts for
    none)."""
    led = dict.fromkeys(sides, 0)
    for index in range(min(len(runs[side]) for side in sides)):
        leader, _ = best_of(
            {side: runs[side][index].get(WINNER_BY) for side in sides}, sides, higher=True
        )
        if leader is not None:
            led[leader] += 1
    return led


def compare_runs(
    runs: Mapping[str, Sequence[Run]], request_rate: float | str | None = None
) -> dict[str, object]:
    """One comparison of the sides in `runs` (two or three of `SIDES`): the median run of each
    side, the ratios, the winner, and every run."""
    sides = check_sides(tuple(runs))
    medians: dict[str, dict[str, object]] = {}
    for side in sides:
        side_runs = runs[side]
        index = median_index([_number(run.get(MEDIAN_BY)) for run in side_runs])
        medians[side] = {"run_index": index, **side_runs[index]}
    request_class = itl_class(medians[sides[0]])
    report: dict[str, object] = {}
    if request_rate is not None:
        report["request_rate"] = request_rate
    report.update(
        {"median_by": MEDIAN_BY, "itl_p99_class": request_class, "sides": list(sides), **medians}
    )
    if BASELINE in medians:
        ratios = {
            side: ratios_against(medians[side], medians[BASELINE], request_class)
            for side in sides
            if side != BASELINE
        }
        report["ratios"] = ratios
        # The keys of the two-sided comparison: disaggregated / colocated.
        report.update(ratios.get("disaggregated", {}))
    effective: dict[str, float | None] = {
        side: median_figure(runs[side], WINNER_BY) for side in sides
    }
    report["effective_throughput_medians"] = effective
    report["rounds_led"] = rounds_led(runs, sides)
    others = [side for side in sides if side != "conditional"]
    if "conditional" in medians:
        best_side, best = best_of(effective, others, higher=True)
        itls: dict[str, object] = {
            side: figure_of(medians[side], "p99_itl_ms", request_class) for side in sides
        }
        itl_side, lowest = best_of(itls, others, higher=False)
        report.update(
            {
                "best_other_side": best_side,
                "conditional_vs_best_effective_throughput": ratio(effective["conditional"], best),
                "best_other_itl_side": itl_side,
                "conditional_vs_best_itl_p99": ratio(itls["conditional"], lowest),
            }
        )
    winner, top = best_of(effective, sides, higher=True)
    report["winner"] = winner if top else None
    report["runs"] = {side: [dict(run) for run in runs[side]] for side in sides}
    return report


def sides_of(report: Mapping[str, object]) -> tuple[Side, ...]:
    """The sides a report holds (a report from before "sides": colocated and disaggregated)."""
    listed = report.get("sides")
    if isinstance(listed, list):
        return check_sides([str(side) for side in listed])
    return check_sides([side for side in SIDES if side in report])


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
    """The median runs side by side, their ratios to the first side (colocated when it is
    there), the winner, and every run's headline figure."""
    sides = sides_of(report)
    medians = {side: _mapping(report[side]) for side in sides}
    base, others = sides[0], sides[1:]
    rows = [(label, name, "all") for label, name in _ROWS]
    request_class = str(report["itl_p99_class"])
    for cls in dict.fromkeys((request_class, "all")):
        rows.append((f"Median ITL, {cls} requests (ms)", "median_itl_ms", cls))
        rows.append((f"P99 ITL, {cls} requests (ms)", "p99_itl_ms", cls))
    widths = {side: max(14, len(side) + 3) for side in sides}
    lines = _header(report, sides)
    lines.append(
        f"{'':<34}"
        + "".join(f"{side:>{widths[side]}}" for side in sides)
        + "".join(f"{_ratio_label(side, base):>8}" for side in others)
    )
    for label, name, cls in rows:
        figures = {side: figure_of(medians[side], name, cls) for side in sides}
        lines.append(
            f"{label:<34}"
            + "".join(f"{_cell(figures[side]):>{widths[side]}}" for side in sides)
            + "".join(f"{_cell(ratio(figures[side], figures[base])):>8}" for side in others)
        )
    effective = _mapping(report.get("effective_throughput_medians", {}))
    led = _mapping(report.get("rounds_led", {}))
    lines.append(
        f"{'Effective tok/s, median of runs':<34}"
        + "".join(f"{_cell(effective.get(side)):>{widths[side]}}" for side in sides)
        + "".join(f"{_cell(ratio(effective.get(side), effective.get(base))):>8}" for side in others)
    )
    lines.append(
        f"{'Rounds led (effective tok/s)':<34}"
        + "".join(f"{_cell(led.get(side)):>{widths[side]}}" for side in sides)
    )
    lines.append(f"Winner by effective throughput: {report.get('winner') or 'none'}")
    if "conditional_vs_best_effective_throughput" in report:
        lines.append(
            "Conditional / the better of the others: "
            f"{_cell(report['conditional_vs_best_effective_throughput'])} effective tok/s "
            f"(vs {report.get('best_other_side') or 'n/a'}), "
            f"{_cell(report.get('conditional_vs_best_itl_p99'))} p99 ITL "
            f"(vs {report.get('best_other_itl_side') or 'n/a'})"
        )
    runs = _mapping(report["runs"])
    for side in sides:
        side_runs = _runs(runs[side])
        outputs = ", ".join(_cell(run.get(MEDIAN_BY)) for run in side_runs)
        effectives = ", ".join(_cell(run.get(WINNER_BY)) for run in side_runs)
        lines.append(f"{side} runs, output tok/s: {outputs}; effective tok/s: {effectives}")
    return "\n".join(lines)


def _ratio_label(side: Side, base: Side) -> str:
    return f"{SIDE_LETTERS[side]}/{SIDE_LETTERS[base]}"


def _header(report: Mapping[str, object], sides: Sequence[Side]) -> list[str]:
    """What the figures are of, when the report says (the command's top-level report does)."""
    if "cpus" not in report:
        return []
    rate = report.get("request_rate")
    at = f" at {_cell(rate)} req/s" if rate is not None else ""
    names = ", ".join(f"{side} ({SIDE_LETTERS[side]})" for side in sides)
    return [
        f"{names} on CPUs {report['cpus']}{at}: the median of "
        f"{report.get('repeats')} run(s) per side by output throughput (effective throughput: "
        "each side's median over its runs)"
    ]


def format_sweep(points: Sequence[Mapping[str, object]]) -> str:
    """One row per request rate: effective throughput and p99 ITL of every side, their ratios
    to the first side, conditional over the better of the others, and the winner."""
    if not points:
        return ""
    sides = sides_of(points[0])
    base, others = sides[0], sides[1:]
    letters = [SIDE_LETTERS[side] for side in sides]
    versus_best = "conditional_vs_best_effective_throughput" in points[0]
    header = (
        f"{'rate (req/s)':>12}"
        + "".join(f"{'eff tok/s ' + letter:>13}" for letter in letters)
        + "".join(f"{_ratio_label(side, base):>7}" for side in others)
        + "".join(f"{'p99 ITL ' + letter:>12}" for letter in letters)
        + "".join(f"{_ratio_label(side, base):>7}" for side in others)
        + (f"{'a/best':>8}" if versus_best else "")
        + f"{'led ' + '/'.join(letters):>11}"
        + f"{'winner':>15}"
    )
    lines = [header]
    for point in points:
        medians = {side: _mapping(point[side]) for side in sides}
        request_class = str(point["itl_p99_class"])
        throughputs = _mapping(point["effective_throughput_medians"])
        led = _mapping(point["rounds_led"])
        itls: dict[str, object] = {
            side: figure_of(medians[side], "p99_itl_ms", request_class) for side in sides
        }
        lines.append(
            f"{_cell(point.get('request_rate')):>12}"
            + "".join(f"{_cell(throughputs[side]):>13}" for side in sides)
            + "".join(f"{_cell(ratio(throughputs[side], throughputs[base])):>7}" for side in others)
            + "".join(f"{_cell(itls[side]):>12}" for side in sides)
            + "".join(f"{_cell(ratio(itls[side], itls[base])):>7}" for side in others)
            + (
                f"{_cell(point.get('conditional_vs_best_effective_throughput')):>8}"
                if versus_best
                else ""
            )
            + f"{'/'.join(_cell(led.get(side)) for side in sides):>11}"
            + f"{point.get('winner') or 'none':>15}"
        )
    which = str(points[0]["itl_p99_class"])
    names = ", ".join(f"{letter}: {side}" for side, letter in zip(sides, letters, strict=True))
    lines.append(
        f"(effective tok/s: each side's median over its runs, and the rounds each led; ITL in "
        f"ms, {which} requests, of each side's median run by output tok/s; {names}; winner by "
        "median effective tok/s)"
    )
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
