"""`nori bench soak`: its verdicts on a fixed trace, and a 24-second run against a real cluster
(what CI runs; docs/operations.md has the 30-minute one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nori.bench.soak import SoakSettings, soak_report


def _window(t_s: float, tps: float, rss: float) -> dict[str, object]:
    return {
        "t_s": t_s,
        "output_throughput": tps,
        "completed": 10,
        "failed": 0,
        "rss_mib": {"gateway": 100.0, "decode-0": rss},
        "kv_blocks": {},
    }


def test_the_verdicts_on_a_fixed_trace() -> None:
    settings = SoakSettings(minutes=30, window_s=60)
    # 30 one-minute windows: steady at 100 tok/s, then the last 5 minutes at 94.
    windows = [_window(60.0 * (i + 1), 100.0 if i < 25 else 94.0, 200.0) for i in range(30)]
    report = soak_report(settings, windows, {"decode-0": 50}, {"decode-0": 50})
    assert report["first_span_output_throughput"] == 100.0
    assert report["last_span_output_throughput"] == 94.0
    assert report["throughput_ratio"] == pytest.approx(0.94)
    assert report["ok"] == {"throughput": False, "rss": True, "blocks": True, "no_failures": True}
    # RSS up 6% and one block missing at the end.
    windows[-1] = _window(1800.0, 100.0, 212.0)
    report = soak_report(settings, windows, {"decode-0": 50}, {"decode-0": 49})
    assert report["rss_growth"]["decode-0"] == pytest.approx(0.06)
    assert report["leaked_blocks"] == {"decode-0": 1}
    assert not report["ok"]["rss"] and not report["ok"]["blocks"]


def test_a_short_run_compares_its_last_third_with_its_first() -> None:
    windows = [_window(10.0 * (i + 1), float(100 + i), 200.0) for i in range(6)]
    report = soak_report(SoakSettings(minutes=1, window_s=10), windows, {}, {})
    assert report["span_s"] == 20.0
    assert report["first_span_output_throughput"] == 100.5  # windows at 10 and 20 s
    assert report["last_span_output_throughput"] == 104.5  # windows at 50 and 60 s


@pytest.mark.slow
def test_a_short_soak_against_a_real_cluster(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "nori.cli.main", "bench", "soak", "--minutes", "0.25",
            "--window-s", "3", "--max-concurrency", "8", "--input-len", "64",
            "--output-len", "32", "--out-dir", str(tmp_path), "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert summary["num_windows"] == len(report["windows"]) >= 3
    assert summary["completed"] > 0 and summary["failed"] == 0
    assert summary["leaked_blocks"] == {"prefill-0": 0, "decode-0": 0}
    for window in report["windows"]:
        assert set(window["rss_mib"]) == {"prefill-0", "decode-0", "gateway"}
        assert all(mib > 10 for mib in window["rss_mib"].values())
        for blocks in window["kv_blocks"].values():
            assert 0 <= blocks["free"] <= blocks["total"]
