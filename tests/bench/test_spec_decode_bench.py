"""`nori bench spec-decode` end to end on stories260K: both sides run the same prompts, the
speculative side verifies drafts, and greedy outputs are identical in float32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
SHAREGPT = ROOT.parent / "shared" / "data" / "sharegpt" / "ShareGPT_V3_sample2000.json"


def test_the_benchmark_compares_both_sides_on_the_same_prompts(tmp_path: Path) -> None:
    if not (STORIES / "config.json").exists() or not SHAREGPT.exists():
        pytest.skip("stories260K or the ShareGPT sample is not beside the checkout")
    output = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "nori.cli.main", "bench", "spec-decode",
        "--model", str(STORIES), "--dtype", "float32", "--batch-sizes", "1,4",
        "--batches-per-size", "1", "--max-tokens", "24", "--rounds", "2",
        "--max-prompt-len", "256", "--json", "-o", str(output),
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    report = json.loads(output.read_text())
    assert report["speculative_config"]["num_speculative_tokens"] == 3
    assert [row["batch_size"] for row in report["rows"]] == [1, 4]
    for row in report["rows"]:
        assert row["outputs_identical"] == row["outputs_compared"] == row["num_prompts"]
        assert len(row["decode_speedups"]) == 2
        assert row["plain_decode_tokens_per_s"] > 0 and row["spec_decode_tokens_per_s"] > 0
        assert row["mean_accepted_length"] is not None and row["mean_accepted_length"] > 1
    assert "CPUs" in report["host"]
