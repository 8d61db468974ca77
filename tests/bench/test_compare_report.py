"""`nori bench compare`'s figures on fixed results: median runs, ratios, winners, tables, plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nori.bench.compare import CompareSettings, parse_rates
from nori.bench.compare_plot import plot_sweep
from nori.bench.compare_report import (
    compare_runs,
    format_comparison,
    format_sweep,
    median_index,
    parse_sides,
    ratio,
)
from nori.cli.engine_args import worker_args


def run(output: float, effective: float, p99_itl: float, short_p99_itl: float | None = None):
    """The figures of one `bench serve` run that the comparison reads."""
    figures: dict[str, object] = {
        "completed": 10,
        "failed": 0,
        "output_throughput": output,
        "effective_throughput": effective,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": 300.0,
        "median_itl_ms": p99_itl / 4,
        "p99_itl_ms": p99_itl,
    }
    if short_p99_itl is not None:
        figures["short"] = {"p99_itl_ms": short_p99_itl, "median_itl_ms": short_p99_itl / 4}
        figures["long"] = {"p99_itl_ms": 1.0}
    return figures


def test_median_index() -> None:
    assert median_index([5.0]) == 0
    assert median_index([3.0, 1.0, 2.0]) == 2
    assert median_index([4.0, 1.0, 3.0, 2.0]) == 3  # the lower middle one of an even count
    with pytest.raises(ValueError):
        median_index([])


def test_ratio() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1, 4) == 0.25
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 2.0) is None and ratio(2.0, None) is None
    assert ratio(1.0, math.nan) is None


def test_mixed_comparison_takes_each_sides_median_run_and_the_short_requests_itl() -> None:
    runs = {
        "colocated": [
            run(100.0, 90.0, 50.0, 40.0),
            run(120.0, 100.0, 60.0, 80.0),
            run(80.0, 70.0, 70.0, 90.0),
        ],
        "disaggregated": [
            run(130.0, 110.0, 30.0, 20.0),
            run(90.0, 85.0, 35.0, 25.0),
            run(110.0, 99.0, 45.0, 30.0),
        ],
    }
    report = compare_runs(runs, request_rate=4.0)
    # Median by output throughput: colocated 100 (run 0), disaggregated 110 (run 2).
    colocated, disaggregated = report["colocated"], report["disaggregated"]
    assert isinstance(colocated, dict) and isinstance(disaggregated, dict)
    assert (colocated["run_index"], disaggregated["run_index"]) == (0, 2)
    assert colocated["output_throughput"] == 100.0 and disaggregated["output_throughput"] == 110.0
    assert report["request_rate"] == 4.0
    assert report["median_by"] == "output_throughput"
    assert report["itl_p99_class"] == "short"
    assert report["itl_p99_ratio"] == pytest.approx(30.0 / 40.0)
    assert report["itl_p99_ratio_all"] == pytest.approx(45.0 / 50.0)
    assert report["effective_throughput_ratio"] == pytest.approx(99.0 / 90.0)
    assert report["output_throughput_ratio"] == pytest.approx(1.1)
    assert report["runs"] == runs
    # Two sides: no conditional keys; the winner by effective throughput.
    assert report["sides"] == ["colocated", "disaggregated"]
    assert report["winner"] == "disaggregated"
    assert "conditional" not in report and "conditional_vs_best_effective_throughput" not in report
    assert report["ratios"] == {
        "disaggregated": {
            "itl_p99_ratio": report["itl_p99_ratio"],
            "itl_p99_ratio_all": report["itl_p99_ratio_all"],
            "effective_throughput_ratio": report["effective_throughput_ratio"],
            "output_throughput_ratio": report["output_throughput_ratio"],
        }
    }


def three_sides(conditional: list[dict[str, object]]) -> dict[str, list[dict[str, object]]]:
    return {
        "colocated": [run(100.0, 90.0, 50.0, 40.0), run(80.0, 70.0, 70.0, 90.0)],
        "disaggregated": [run(110.0, 99.0, 45.0, 30.0)],
        "conditional": conditional,
    }


def test_three_sides_judge_conditional_against_colocated_and_the_better_of_the_others() -> None:
    # Median by output throughput (lower middle of two): colocated 80 (run 1): eff 70, ITL 90.
    report = compare_runs(
        three_sides([run(120.0, 105.0, 60.0, 36.0), run(100.0, 80.0, 40.0, 20.0)]), 2.0
    )
    assert report["sides"] == ["colocated", "disaggregated", "conditional"]
    conditional = report["conditional"]
    assert isinstance(conditional, dict) and conditional["run_index"] == 1
    ratios = report["ratios"]
    assert isinstance(ratios, dict) and set(ratios) == {"disaggregated", "conditional"}
    assert ratios["conditional"]["effective_throughput_ratio"] == pytest.approx(80.0 / 70.0)
    assert ratios["conditional"]["itl_p99_ratio"] == pytest.approx(20.0 / 90.0)
    assert ratios["conditional"]["itl_p99_ratio_all"] == pytest.approx(40.0 / 70.0)
    assert ratios["conditional"]["output_throughput_ratio"] == pytest.approx(100.0 / 80.0)
    # The old flat keys stay disaggregated / colocated.
    assert report["effective_throughput_ratio"] == pytest.approx(99.0 / 70.0)
    assert report["itl_p99_ratio"] == pytest.approx(30.0 / 90.0)
    # Against the better of the others: the highest effective throughput (disaggregated, 99),
    # the lowest short-request p99 ITL (disaggregated, 30).
    assert report["best_other_side"] == "disaggregated"
    assert report["conditional_vs_best_effective_throughput"] == pytest.approx(80.0 / 99.0)
    assert report["best_other_itl_side"] == "disaggregated"
    assert report["conditional_vs_best_itl_p99"] == pytest.approx(20.0 / 30.0)
    assert report["winner"] == "disaggregated"


def test_effective_throughput_is_judged_over_every_run_not_the_median_run() -> None:
    """Colocated's median run by output tok/s (its second) had a bad round (effective 120):
    the conditional side is judged against colocated's median effective tok/s over its runs
    (190), and each round's leader is counted."""
    colocated = [run(300.0, 290.0, 50.0), run(250.0, 120.0, 50.0), run(200.0, 190.0, 50.0)]
    conditional = [run(260.0, 260.0, 40.0), run(240.0, 240.0, 40.0), run(250.0, 250.0, 40.0)]
    report = compare_runs({"colocated": colocated, "conditional": conditional})
    assert report["colocated"]["run_index"] == 1  # type: ignore[index]
    assert report["effective_throughput_medians"] == {"colocated": 190.0, "conditional": 250.0}
    assert report["rounds_led"] == {"colocated": 1, "conditional": 2}
    assert report["conditional_vs_best_effective_throughput"] == pytest.approx(250.0 / 190.0)
    assert report["winner"] == "conditional"
    # A side that met no SLO in any run has no median to compare.
    failed = compare_runs({"colocated": [run(10.0, math.nan, 5.0)], "conditional": conditional})
    assert failed["effective_throughput_medians"] == {"colocated": None, "conditional": 250.0}
    assert failed["conditional_vs_best_effective_throughput"] is None


def test_conditional_wins_when_its_effective_throughput_is_highest() -> None:
    report = compare_runs(three_sides([run(100.0, 120.0, 40.0, 50.0)]))
    assert report["winner"] == "conditional"
    assert report["conditional_vs_best_effective_throughput"] == pytest.approx(120.0 / 99.0)
    # Its ITL is worse than disaggregated's: above 1.
    assert report["conditional_vs_best_itl_p99"] == pytest.approx(50.0 / 30.0)


def test_the_better_side_is_chosen_figure_by_figure_and_ties_go_to_the_first() -> None:
    runs = {
        "colocated": [run(100.0, 99.0, 50.0, 10.0)],
        "disaggregated": [run(100.0, 99.0, 50.0, 30.0)],
        "conditional": [run(100.0, 99.0, 50.0, 20.0)],
    }
    report = compare_runs(runs)
    assert report["best_other_side"] == "colocated" and report["winner"] == "colocated"
    assert report["conditional_vs_best_effective_throughput"] == 1.0
    assert report["best_other_itl_side"] == "colocated"
    assert report["conditional_vs_best_itl_p99"] == pytest.approx(2.0)


def test_no_winner_when_no_side_meets_the_slos() -> None:
    report = compare_runs(
        {"colocated": [run(10.0, 0.0, 20.0)], "conditional": [run(12.0, 0.0, 10.0)]}
    )
    assert report["winner"] is None
    assert report["conditional_vs_best_effective_throughput"] is None  # 0 / 0
    assert report["conditional_vs_best_itl_p99"] == 0.5
    assert "effective_throughput_ratio" not in report  # no disaggregated side
    assert report["ratios"] == {
        "conditional": {
            "itl_p99_ratio": 0.5,
            "itl_p99_ratio_all": 0.5,
            "effective_throughput_ratio": None,
            "output_throughput_ratio": 1.2,
        }
    }


def test_sides_are_checked() -> None:
    assert parse_sides("conditional, colocated") == ("colocated", "conditional")
    assert parse_sides("colocated,disaggregated,conditional") == (
        "colocated",
        "disaggregated",
        "conditional",
    )
    with pytest.raises(ValueError, match="unknown side 'auto'"):
        parse_sides("colocated,auto")
    with pytest.raises(ValueError, match="two or three"):
        parse_sides("colocated,colocated")
    with pytest.raises(ValueError, match="two or three"):
        compare_runs({"colocated": [run(1.0, 1.0, 1.0)]})
    with pytest.raises(ValueError, match="in that order"):
        CompareSettings(sides=("disaggregated", "colocated"))  # type: ignore[arg-type]


def test_other_datasets_judge_the_itl_of_all_requests() -> None:
    report = compare_runs(
        {"colocated": [run(10.0, 10.0, 20.0)], "disaggregated": [run(5.0, 0.0, 10.0)]}
    )
    assert "request_rate" not in report
    assert report["itl_p99_class"] == "all"
    assert report["itl_p99_ratio"] == report["itl_p99_ratio_all"] == 0.5
    assert report["effective_throughput_ratio"] == 0.0


def test_comparison_table() -> None:
    report = compare_runs(
        {
            "colocated": [run(100.0, 90.0, 50.0, 40.0)],
            "disaggregated": [run(110.0, 99.0, 45.0, 30.0)],
        }
    )
    table = format_comparison(report)
    lines = table.splitlines()
    assert lines[0].split() == ["colocated", "disaggregated", "d/c"]
    rows = {line[:34].strip(): line[34:].split() for line in lines[1:-3]}
    assert rows["Effective throughput (tok/s)"] == ["90.00", "99.00", "1.10"]
    assert rows["Effective tok/s, median of runs"] == ["90.00", "99.00", "1.10"]
    assert rows["Rounds led (effective tok/s)"] == ["0", "1"]
    assert rows["P99 ITL, short requests (ms)"] == ["40.00", "30.00", "0.75"]
    assert rows["P99 ITL, all requests (ms)"] == ["50.00", "45.00", "0.90"]
    assert rows["Failed requests"] == ["0", "0", "n/a"]
    assert lines[-3:] == [
        "Winner by effective throughput: disaggregated",
        "colocated runs, output tok/s: 100.00; effective tok/s: 90.00",
        "disaggregated runs, output tok/s: 110.00; effective tok/s: 99.00",
    ]


def test_three_sided_table() -> None:
    report = compare_runs(three_sides([run(120.0, 105.0, 60.0, 36.0)]))
    lines = format_comparison(report).splitlines()
    assert lines[0].split() == ["colocated", "disaggregated", "conditional", "d/c", "a/c"]
    rows = {line[:34].strip(): line[34:].split() for line in lines[1:-5]}
    assert rows["Effective throughput (tok/s)"] == ["70.00", "99.00", "105.00", "1.41", "1.50"]
    assert rows["P99 ITL, short requests (ms)"] == ["90.00", "30.00", "36.00", "0.33", "0.40"]
    # Over the runs: colocated's lower middle of 90 and 70; one round each for the others.
    assert rows["Effective tok/s, median of runs"] == [
        *("70.00", "99.00", "105.00", "1.41", "1.50")
    ]
    assert rows["Rounds led (effective tok/s)"] == ["0", "0", "1"]
    assert lines[-5:] == [
        "Winner by effective throughput: conditional",
        "Conditional / the better of the others: 1.06 effective tok/s (vs disaggregated), "
        "1.20 p99 ITL (vs disaggregated)",
        "colocated runs, output tok/s: 100.00, 80.00; effective tok/s: 90.00, 70.00",
        "disaggregated runs, output tok/s: 110.00; effective tok/s: 99.00",
        "conditional runs, output tok/s: 120.00; effective tok/s: 105.00",
    ]


def sweep_points(conditional: bool = False) -> list[dict[str, object]]:
    points = []
    for rate, c, d, a in ((1.0, 50.0, 40.0, 55.0), (4.0, 100.0, 120.0, 110.0)):
        runs = {"colocated": [run(c, c, 10.0, 8.0)], "disaggregated": [run(d, d, 9.0, 4.0)]}
        if conditional:
            runs["conditional"] = [run(a, a, 9.5, 6.0)]
        points.append(compare_runs(runs, request_rate=rate))
    return points


def test_sweep_table_has_one_row_per_rate() -> None:
    rows = format_sweep(sweep_points()).splitlines()
    assert rows[0].split()[-1] == "winner"
    assert rows[1].split() == [
        *("1.00", "50.00", "40.00", "0.80", "8.00", "4.00", "0.50", "1/0", "colocated")
    ]
    assert rows[2].split() == [
        *("4.00", "100.00", "120.00", "1.20", "8.00", "4.00", "0.50", "0/1", "disaggregated")
    ]
    assert "short requests" in rows[3]


def test_three_sided_sweep_table() -> None:
    rows = format_sweep(sweep_points(conditional=True)).splitlines()
    assert rows[0].split()[-4:] == ["a/best", "led", "c/d/a", "winner"]
    # rate, eff c d a, d/c a/c, p99 ITL c d a, d/c a/c, a/best, rounds led, winner
    assert rows[1].split() == [
        *("1.00", "50.00", "40.00", "55.00", "0.80", "1.10"),
        *("8.00", "4.00", "6.00", "0.50", "0.75", "1.10", "0/0/1", "conditional"),
    ]
    assert rows[2].split()[-3:] == ["0.92", "0/1/0", "disaggregated"]
    assert "a: conditional" in rows[3]


@pytest.mark.parametrize("conditional", [False, True])
def test_sweep_plot(tmp_path: Path, conditional: bool) -> None:
    path = plot_sweep(sweep_points(conditional), tmp_path / "sweep.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000


def test_settings_and_options_are_checked() -> None:
    assert parse_rates("1, 2.5,4") == (1.0, 2.5, 4.0)
    with pytest.raises(ValueError, match="--sweep 'a,b'"):
        parse_rates("a,b")
    with pytest.raises(ValueError, match="finite and > 0"):
        CompareSettings(request_rates=(1.0, math.inf))
    with pytest.raises(ValueError, match="--repeats"):
        CompareSettings(repeats=0)
    assert CompareSettings(request_rates=(2.0,)).rates == (2.0,)
    assert CompareSettings().rates == (math.inf,)
    assert CompareSettings().sides == ("colocated", "disaggregated", "conditional")
    assert worker_args("--num-kv-blocks 64 --dtype float32") == (
        "--num-kv-blocks",
        "64",
        "--dtype",
        "float32",
    )
    for bad, message in (
        ("--model x", "give the model with --model"),
        ("--bogus 1", "not an engine option: --bogus 1"),
        ("--dtype int3", "--worker-args: argument --dtype: invalid choice"),
    ):
        with pytest.raises(ValueError, match=message):
            worker_args(bad)


def test_a_sweep_with_a_duration_needs_no_request_rate_of_its_own() -> None:
    from nori.cli.cluster_bench import compare_settings_from_args
    from nori.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "compare", "--duration", "20", "--sweep", "2,4"])
    settings = compare_settings_from_args(args)
    assert settings.rates == (2.0, 4.0) and settings.workload.duration_s == 20.0
    assert settings.sides == ("colocated", "disaggregated", "conditional")
    without = parser.parse_args(["bench", "compare", "--duration", "20"])
    with pytest.raises(ValueError, match="--duration needs a finite --request-rate"):
        compare_settings_from_args(without)


def test_sides_and_the_conditional_workload_from_the_command_line() -> None:
    from nori.bench.compare import cpu_plans
    from nori.cli.cluster_bench import compare_settings_from_args
    from nori.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(
        [
            *("bench", "compare", "--sides", "colocated,conditional", "--request-rate", "4"),
            *("--long-fraction", "0.2", "--long-input-len", "1500", "--long-range-ratio", "0.333"),
        ]
    )
    settings = compare_settings_from_args(args)
    assert settings.sides == ("colocated", "conditional")
    workload = settings.workload
    assert (workload.dataset, workload.long_fraction, workload.long_range_ratio) == (
        "mixed",
        0.2,
        0.333,
    )
    plans = cpu_plans(frozenset({0, 1, 2, 3}), settings)
    assert set(plans) == {"colocated", "conditional"}
    names = [placement.name for placement in plans["conditional"].placements]
    assert names == ["prefill-0", "decode-0", "gateway"]
    rejected = parser.parse_args(["bench", "compare", "--disaggregation", "auto"])
    with pytest.raises(ValueError, match="--disaggregation: bench compare sets it per side"):
        compare_settings_from_args(rejected)
