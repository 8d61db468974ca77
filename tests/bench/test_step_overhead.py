"""`nori bench step-overhead`: its phases add up to the step, and the CLI's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nori.bench.step_overhead import measure, step_floor_ms
from nori.engine.config import EngineConfig
from nori.engine.model_runner import ModelRunner
from nori.models.init_checkpoint import init_checkpoint


def test_the_phases_add_up_to_the_step(tmp_path: Path) -> None:
    model = init_checkpoint(tmp_path / "tiny", "tiny")
    config = EngineConfig(model=str(model), num_kv_blocks=256, max_num_seqs=4)
    result = measure(config, batch=4, prompt_len=8, steps=3, repeats=3)
    assert result.batch == 4
    assert result.forward_ms > 0 and result.schedule_ms > 0 and result.inputs_and_sampling_ms > 0
    assert result.host_ms == pytest.approx(result.step_ms - result.forward_ms)
    parts = result.schedule_ms + result.inputs_and_sampling_ms + result.update_and_outputs_ms
    assert parts == pytest.approx(result.host_ms)


@pytest.mark.slow
def test_the_cli_prints_one_json_object_and_refuses_bad_sizes(tmp_path: Path) -> None:
    model = init_checkpoint(tmp_path / "tiny", "tiny")
    command = [sys.executable, "-m", "nori.cli.main", "bench", "step-overhead"]
    bad = subprocess.run(
        [*command, "--batch-sizes", "4,x"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--batch-sizes" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    args = ["--model", str(model), "--batch-sizes", "2,3", "--steps", "2", "--repeats", "1"]
    good = subprocess.run([*command, *args, "--json"], capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stderr
    report = json.loads(good.stdout)
    assert [r["batch"] for r in report["results"]] == [2, 3]
    assert all(r["host_ms"] > 0 for r in report["results"])


def test_the_floor_reads_the_weights_once_and_the_context_kv(tmp_path: Path) -> None:
    model = init_checkpoint(tmp_path / "tiny", "tiny")
    config = EngineConfig(model=str(model), num_kv_blocks=64, dtype="float32")
    runner = ModelRunner(config, model)
    weights = sum(p.numel() * 4 for p in runner.model.parameters())
    # tiny: 2 layers x (k and v) x 2 kv heads x 16 dims x 4 bytes per token
    kv_per_token = 2 * 2 * 2 * 16 * 4
    assert step_floor_ms(runner, 0, 1e9) == pytest.approx(weights / 1e9 * 1000)
    assert step_floor_ms(runner, 100, 1e9) == pytest.approx(
        (weights + 100 * kv_per_token) / 1e9 * 1000
    )
