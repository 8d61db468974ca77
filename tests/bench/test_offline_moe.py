"""`nori bench offline` on a mixture-of-experts model: the continuous run's tokens per expert per
routed layer, max/mean, and their sum checked against forwarded tokens x top_k x routed layers,
in the JSON report and the printed table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nori.bench.offline import RunResult, expert_load_report, run_offline_benchmark
from nori.engine.config import EngineConfig
from nori.engine.outputs import ExpertRoutingCounts, expert_imbalance
from tests.engine.moe_checkpoints import write_moe_checkpoint


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe_checkpoint(tmp_path_factory.mktemp("bench-moe"), "qwen2_moe")


def test_offline_report_has_the_expert_load(qwen2_moe: Path) -> None:
    config = EngineConfig(model=str(qwen2_moe), dtype="float32", block_size=8, num_kv_blocks=128)
    report = run_offline_benchmark(
        config,
        num_prompts=4,
        input_range=(4, 24),
        output_range=(2, 8),
        compare_static=True,
        show_progress=False,
        repeats=1,
    )
    # The warm-up run and the static run share the model (its counters): only the reported
    # continuous run is counted. Forwarded: every prompt position, each output token but the last.
    forwarded = report["input_tokens"] + report["output_tokens"] - report["num_prompts"]
    assert report["continuous_preemptions"] == 0
    assert report["moe_tokens_forwarded"] == forwarded
    assert report["moe_top_k"] == 2 and report["moe_routed_layers"] == 2
    assert report["moe_routed_tokens"] == report["moe_routed_tokens_expected"] == forwarded * 2 * 2
    worst = 0.0
    for layer in (0, 2):  # layer 1 is dense
        counts = report[f"moe_layer_{layer}_expert_tokens"]
        assert len(counts) == 8 and sum(counts) == forwarded * 2
        imbalance = report[f"moe_layer_{layer}_imbalance"]
        assert imbalance == pytest.approx(expert_imbalance(tuple(counts)), abs=1e-3)
        worst = max(worst, imbalance)
    assert "moe_layer_1_expert_tokens" not in report
    assert report["moe_imbalance_max"] == worst
    json.dumps(report)  # the --json output


def test_a_miscount_fails_the_run() -> None:
    """The sum check is live: a count that is not tokens x top_k x layers raises."""
    run = RunResult(
        policy="continuous",
        seconds=1.0,
        num_output_tokens=4,
        num_input_tokens=10,
        num_steps=4,
        num_preemptions=0,
        num_tokens_forwarded=13,
        expert_load=ExpertRoutingCounts(top_k=2, layers=((0, (10, 10, 5, 2)),)),
    )
    with pytest.raises(
        RuntimeError,
        match="counted 27 routed tokens, expected 13 tokens x top_k 2 x 1 routed layers = 26",
    ):
        expert_load_report(run, exact=True)
    # Preemption or drafts: no check, the counts still reported.
    assert expert_load_report(run, exact=False)["moe_routed_tokens_expected"] is None
    assert expert_load_report(RunResult("continuous", 1.0, 4, 10, 4, 0), exact=True) == {}


def test_nori_bench_offline_prints_the_expert_table(qwen2_moe: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "nori.cli.main", "bench", "offline", "--model", str(qwen2_moe),
            "--dtype", "float32", "--num-prompts", "3", "--input-len-range", "4:12",
            "--output-len-range", "2:4", "--num-kv-blocks", "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in result.stdout.splitlines())
    }
    assert lines["moe_routed_tokens"] == lines["moe_routed_tokens_expected"]
    for layer in (0, 2):
        counts = json.loads(lines[f"moe_layer_{layer}_expert_tokens"])
        assert len(counts) == 8 and sum(counts) == int(lines["moe_routed_tokens"]) // 2
        assert 1.0 <= float(lines[f"moe_layer_{layer}_imbalance"]) <= 8.0
