"""`nori bench compare` as a user runs it: a real subprocess that starts a colocated, a
disaggregated and a conditional (`--disaggregation auto`) cluster (tiny random checkpoint) and
loads each with a handful of requests; the table test compares two sides only (`--sides`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nori.models.init_checkpoint import init_checkpoint

pytestmark = pytest.mark.slow

SIDES = ("colocated", "disaggregated", "conditional")
# A handful of short requests; the mixed dataset's long prompts just fit the tiny context (1024).
# 16 tokens each: a gateway that fell behind sends queued tokens as one event, and a request
# needs two events with text for an inter-token gap (the tiny model's first token may be none).
WORKLOAD = (
    *("--num-prompts", "4", "--random-input-len", "24", "--random-output-len", "16"),
    *("--long-input-len", "1000", "--long-output-len", "2", "--long-request-rate", "1"),
    *("--ignore-eos", "--num-warmups", "1", "--repeats", "1"),
)
WORKER_ARGS = "--dtype float32 --num-kv-blocks 256 --max-num-seqs 16"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("compare") / "tiny", "tiny", seed=9)


def nori_bench_compare(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "bench", "compare", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def leftover_processes(checkpoint: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-f", str(checkpoint)], capture_output=True, text=True)
    return found.stdout.split()


def check_side(run: dict[str, object]) -> None:
    short = run["short"]
    assert isinstance(short, dict) and short["completed"] == 4
    assert run["failed"] == 0 and run["dataset"] == "mixed"
    assert isinstance(run["effective_throughput"], float) and run["effective_throughput"] > 0
    assert short["p99_itl_ms"] > 0


def test_sweep_json_and_plot(redis_url: str, checkpoint: Path, tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    completed = nori_bench_compare(
        redis_url,
        *("--model", str(checkpoint), "--worker-args", WORKER_ARGS, *WORKLOAD),
        *("--sweep", "4,8", "--json", "--plot", str(plot)),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    data = json.loads(completed.stdout)
    assert data["repeats"] == 1
    assert set(data["cpu_plans"]) == set(SIDES)
    names = [placement["name"] for placement in data["cpu_plans"]["disaggregated"]]
    assert names == ["prefill-0", "decode-0", "gateway"]
    assert data["cpu_plans"]["conditional"] == data["cpu_plans"]["disaggregated"]
    assert [point["request_rate"] for point in data["sweep"]] == [4.0, 8.0]
    for point in data["sweep"]:
        assert point["itl_p99_class"] == "short" and point["median_by"] == "output_throughput"
        for side in SIDES:
            check_side(point[side])
            assert len(point["runs"][side]) == 1 and point[side]["run_index"] == 0
        assert point["sides"] == list(SIDES)
        for name in ("itl_p99_ratio", "itl_p99_ratio_all", "effective_throughput_ratio"):
            assert isinstance(point[name], float) and point[name] > 0, name
            assert point["ratios"]["conditional"][name] > 0, name
        short = [point[side]["short"]["p99_itl_ms"] for side in SIDES]
        assert point["itl_p99_ratio"] == pytest.approx(short[1] / short[0])
        assert point["ratios"]["conditional"]["itl_p99_ratio"] == pytest.approx(short[2] / short[0])
        assert point["conditional_vs_best_itl_p99"] == pytest.approx(short[2] / min(short[:2]))
        effective = [point[side]["effective_throughput"] for side in SIDES]
        assert point["conditional_vs_best_effective_throughput"] == pytest.approx(
            effective[2] / max(effective[:2])
        )
        assert point["winner"] == SIDES[effective.index(max(effective))]
        # Every side of a round got the same short requests.
        inputs = [point[side]["short"]["total_input_tokens"] for side in SIDES]
        assert inputs[0] == inputs[1] == inputs[2] == 4 * 24
    assert plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 10_000
    assert "starting the conditional cluster" in completed.stderr
    assert not leftover_processes(checkpoint), "every cluster was stopped"


def test_one_comparison_table_and_plot(redis_url: str, checkpoint: Path, tmp_path: Path) -> None:
    plot = tmp_path / "compare.png"
    completed = nori_bench_compare(
        redis_url,
        *("--model", str(checkpoint), "--worker-args", WORKER_ARGS, *WORKLOAD),
        *("--dataset", "random", "--request-rate", "8", "--plot", str(plot)),
        *("--sides", "colocated,disaggregated"),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in completed.stdout.splitlines()}
    assert rows["Successful requests"] == ["4", "4", "1.00"]
    assert rows["Failed requests"][:2] == ["0", "0"]
    assert "P99 ITL, all requests (ms)" in rows and "P99 ITL, short requests (ms)" not in rows
    assert plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 10_000
    assert "starting the conditional cluster" not in completed.stderr
    assert not leftover_processes(checkpoint)


def test_bad_options_are_one_line(redis_url: str) -> None:
    completed = nori_bench_compare(redis_url, "--sweep", "4,inf")
    assert completed.returncode == 2
    assert completed.stderr == "nori: error: --sweep rates must be finite and > 0, got inf\n"
