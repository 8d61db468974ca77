"""`python -m nori.bench.export_copy` as a user runs it: one JSON object with each way's time."""

from __future__ import annotations

import json
import subprocess
import sys


def test_export_copy_benchmark_reports_each_way() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nori.bench.export_copy", "--blocks", "8", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nbytes"] == 8 * 2 * 8 * 16 * 8 * 128 * 2
    for way in ("private", "private_then_hashed", "arena_hashed"):
        assert report[f"{way}_ms"] > 0 and report[f"{way}_gbps"] > 0
