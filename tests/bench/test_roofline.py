"""`nori bench roofline`: its floors from the model's shape, and a run on the demo model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nori.bench import roofline
from nori.bench.roofline import (
    HostLimits,
    measure_gemm_tflops,
    measure_read_bandwidth,
    prefill_flops,
    run_roofline,
    weight_bytes,
)
from nori.engine.config import EngineConfig
from nori.models.presets import PRESETS


def test_weight_bytes_count_what_a_decode_step_reads() -> None:
    model = PRESETS["tiny"]
    layer = (
        model.hidden_size
        * (model.num_attention_heads + 2 * model.num_key_value_heads)
        * model.head_dim
        + model.num_attention_heads * model.head_dim * model.hidden_size
        + 3 * model.hidden_size * model.intermediate_size
    )
    head = model.vocab_size * model.hidden_size
    assert weight_bytes(model, torch.float32, None) == 4 * (model.num_hidden_layers * layer + head)
    assert weight_bytes(model, torch.bfloat16, None) == 2 * (model.num_hidden_layers * layer + head)
    # int8 projections, the head in the compute type unless it is quantized too.
    assert weight_bytes(model, torch.bfloat16, "int8") == model.num_hidden_layers * layer + 2 * head
    assert weight_bytes(model, torch.bfloat16, "int8", quantize_lm_head=True) == (
        model.num_hidden_layers * layer + head
    )


def test_weight_bytes_match_the_loaded_models_projections() -> None:
    """The count from the shape against the parameters of the model the engine loads."""
    from nori.engine.model_runner import ModelRunner
    from nori.models.demo import resolve_model

    model_dir = resolve_model("demo")
    runner = ModelRunner(
        EngineConfig(model=str(model_dir), num_kv_blocks=16), model_dir, frozenset()
    )
    config = runner.model_config
    matrices = {
        name: tensor.numel()
        for name, tensor in runner.model.state_dict().items()
        if tensor.ndim == 2 and "embed" not in name and "tied" not in name
    }
    head = config.vocab_size * config.hidden_size
    loaded = sum(matrices.values()) + (head if config.tie_word_embeddings else 0)
    assert weight_bytes(config, torch.float32, None) == 4 * loaded, sorted(matrices)


def test_prefill_flops_are_projections_attention_and_one_head_row() -> None:
    model = PRESETS["tiny"]
    one = prefill_flops(model, 1)
    two = prefill_flops(model, 2)
    attention_per_token2 = 2 * model.num_hidden_layers * model.num_attention_heads * model.head_dim
    head = 2 * model.hidden_size * model.vocab_size
    projections = one - attention_per_token2 - head
    assert projections > 0
    assert two == 2 * projections + 4 * attention_per_token2 + head


def test_host_measurements_are_positive() -> None:
    assert measure_read_bandwidth(1 << 24) > 0
    peaks = measure_gemm_tflops(128)
    assert peaks["float32"] > 0 and peaks["bfloat16"] > 0


def test_a_slow_type_is_measured_at_a_smaller_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A type whose product takes the budget at 256 stops there (bfloat16 on an AVX2-only
    host took 55 s at 2048); a fast one doubles up to the size asked for."""
    sizes: list[int] = []

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        sizes.append(n)
        return torch.ones(1), torch.ones(1)

    monkeypatch.setattr(roofline, "_best_seconds", lambda run: 0.5)
    assert roofline._product_tflops(make, torch.mul, 2048) == 2 * 256**3 / 0.5 / 1e12
    assert sizes == [256]
    sizes.clear()
    monkeypatch.setattr(roofline, "_best_seconds", lambda run: 0.001)
    roofline._product_tflops(make, torch.mul, 2048)
    assert sizes == [256, 512, 1024, 2048]


def test_the_demo_model_against_its_floors() -> None:
    host = HostLimits(read_gb_s=10.0, gemm_tflops={"float32": 1.0, "bfloat16": 2.0})
    config = EngineConfig(model="demo", num_kv_blocks=64)
    report = run_roofline(config, [1, 4], context=32, prompt_len=64, steps=3, host=host)
    assert [row["batch"] for row in report["decode"]] == [1, 4]
    for row in report["decode"]:
        floor_s = (report["weight_bytes"] + row["batch"] * 32 * report["kv_bytes_per_token"]) / 1e10
        assert row["floor_ms"] == pytest.approx(floor_s * 1e3)
        assert row["measured_ms"] > 0 and row["ratio"] == pytest.approx(
            row["measured_ms"] / row["floor_ms"], rel=1e-2
        )
        flops = decode_flops_of(row["batch"], 32)
        assert row["compute_floor_ms"] == pytest.approx(flops / 1e12 * 1e3)
        assert row["roofline_ratio"] == pytest.approx(
            row["measured_ms"] / max(row["floor_ms"], row["compute_floor_ms"]), rel=1e-2
        )
    prefill = report["prefill"]
    assert prefill["floor_ms"] == pytest.approx(prefill_flops_of(report, 64) / 1e12 * 1e3)
    assert report["compute_type"] == "float32"


def decode_flops_of(batch: int, context: int) -> float:
    """The demo model's decode FLOPs counted here from its shape, independently of the code."""
    from nori.models.config import ModelConfig
    from nori.models.demo import resolve_model

    model = ModelConfig.from_dir(resolve_model("demo"))
    hidden, layers = model.hidden_size, model.num_hidden_layers
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    matrices = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * model.intermediate_size
    per_row = layers * (2 * matrices + 4 * q_dim * context) + 2 * hidden * model.vocab_size
    return float(batch * per_row)


def prefill_flops_of(report: dict, prompt_len: int) -> float:
    from nori.models.config import ModelConfig
    from nori.models.demo import resolve_model

    return prefill_flops(ModelConfig.from_dir(resolve_model("demo")), prompt_len)


@pytest.mark.slow
def test_the_cli_prints_one_json_object_and_refuses_bad_sizes() -> None:
    command = [sys.executable, "-m", "nori.cli.main", "bench", "roofline", "--model", "demo"]
    bad = subprocess.run(
        [*command, "--batch-sizes", "1,x"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--batch-sizes" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    good = subprocess.run(
        [
            *command,
            "--batch-sizes",
            "2",
            "--context",
            "16",
            "--prompt-len",
            "32",
            "--steps",
            "2",
            "--num-kv-blocks",
            "32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert good.returncode == 0, good.stderr
    report = json.loads(good.stdout)
    assert report["host"]["read_gb_s"] > 0 and report["decode"][0]["batch"] == 2
