"""`nori bench moe-layer` on a tiny shape: the report's fields and figures are sane."""

from __future__ import annotations

import json

import pytest

from nori.bench.moe_layer import (
    MoeLayerBenchSettings,
    MoeLayerShape,
    format_report,
    parse_batch_sizes,
    run_moe_layer_benchmark,
)
from nori.cli.main import build_parser
from nori.kernels.cpu_build import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels() is None, reason="the C++ CPU kernels need a C++ compiler"
)

TINY = MoeLayerShape(hidden_size=32, num_experts=4, top_k=2, intermediate_size=24)


def test_report_has_one_sane_row_per_dtype_and_batch() -> None:
    settings = MoeLayerBenchSettings(
        shape=TINY, batch_sizes=(1, 5), rounds=2, iterations=2, threads=1
    )
    report = run_moe_layer_benchmark(settings, show=False)
    assert report["benchmark"] == "moe-layer"
    assert report["settings"]["shape"]["num_experts"] == 4
    assert report["torch_threads"] == 1 and report["settings"]["weight_order"] == "each-best"
    assert [(row["dtype"], row["tokens"]) for row in report["results"]] == [
        ("float32", 1),
        ("float32", 5),
        ("bfloat16", 1),
        ("bfloat16", 5),
    ]
    for row in report["results"]:
        assert row["reference_us"] > 0 and row["fused_cpu_us"] > 0
        assert row["speedup"] > 0
        # Both paths computed the same layer (bfloat16 rounds each GEMM).
        assert row["max_abs_difference"] < (1e-4 if row["dtype"] == "float32" else 0.1)
    json.dumps(report)  # the CLI's --json prints it
    table = format_report(report)
    assert "bfloat16" in table and "speed-up" in table


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="dtypes"):
        run_moe_layer_benchmark(MoeLayerBenchSettings(shape=TINY, dtypes=("float16",)), False)
    with pytest.raises(ValueError, match="batch-sizes"):
        parse_batch_sizes("1,x")


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI's default shape, at one small batch and one cheap round (the parser and handler
    # as `nori` runs them; main() itself also installs a fault handler, which capsys refuses).
    args = build_parser().parse_args(
        [
            "bench",
            "moe-layer",
            "--batch-sizes",
            "2",
            "--dtype",
            "float32",
            "--rounds",
            "1",
            "--iterations",
            "1",
            "--weight-order",
            "out-in",
            "--json",
        ]
    )
    assert args.handler(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(row["dtype"], row["tokens"]) for row in report["results"]] == [("float32", 2)]
    assert report["settings"]["shape"]["hidden_size"] == 512
    assert report["settings"]["weight_order"] == "out-in"
