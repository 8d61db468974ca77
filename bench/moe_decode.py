"""`nori bench moe-decode`: decode tokens/s of a mixture-of-experts model beside a dense model
with the same parameters active per token (by default `small-moe` and `small`: 8 experts of half
`small`'s MLP, 2 per token, against `small`'s one MLP).

Per batch size, each model's median decode-step time over `steps` steps with every row decoding
(`nori.bench.roofline.time_decode`), as tokens/s = batch / step time. The two models take turns
within a round and swap who goes first each round, so a slow spell of a shared host hits both;
each ratio (MoE / dense) is a round's, and the report gives the median of the rounds.

A MoE decode step reads more weights than the dense one at any batch where the tokens' choices
cover most experts (at batch 16 with top-2 of 8, nearly all of them): that, and the grouping
work, is what it pays for its larger total parameter count.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from nori.bench.roofline import time_decode
from nori.bench.spec_decode import host_description
from nori.engine.config import EngineConfig
from nori.engine.model_runner import ModelRunner
from nori.models.demo import resolve_model


def run_moe_decode_benchmark(
    config: EngineConfig,
    dense_model: str,
    moe_model: str,
    batch_sizes: tuple[int, ...],
    context: int,
    steps: int,
    rounds: int,
) -> dict[str, Any]:
    sides = {"dense": dense_model, "moe": moe_model}
    runners: dict[str, tuple[EngineConfig, ModelRunner]] = {}
    for side, name in sides.items():
        folder = resolve_model(name)
        side_config = replace(config, model=str(folder))
        runners[side] = (side_config, ModelRunner(side_config, folder, frozenset()))
    rows = []
    for batch in batch_sizes:
        step_seconds: dict[str, list[float]] = {side: [] for side in sides}
        ratios = []
        for round_index in range(rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for side in order:
                side_config, runner = runners[side]
                step_seconds[side].append(time_decode(side_config, runner, batch, context, steps))
            ratios.append(step_seconds["dense"][-1] / step_seconds["moe"][-1])
        rows.append(
            {
                "batch": batch,
                "dense_tok_s": batch / statistics.median(step_seconds["dense"]),
                "moe_tok_s": batch / statistics.median(step_seconds["moe"]),
                "moe_over_dense": statistics.median(ratios),
                "round_ratios": ratios,
            }
        )
    for _, runner in runners.values():
        runner.close()
    return {
        "host": host_description(),
        "dense_model": dense_model,
        "moe_model": moe_model,
        "dtype": config.dtype,
        "quantization": config.quantization,
        "context": context,
        "steps": steps,
        "rounds": rounds,
        "rows": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"decode tokens/s, {report['moe_model']} vs {report['dense_model']} "
        f"({report['dtype']}, quantization {report['quantization']}), context {report['context']}, "
        f"median of {report['rounds']} alternating rounds; {report['host']}",
        f"{'batch':>6} {'dense tok/s':>12} {'moe tok/s':>10} {'moe/dense':>10}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['batch']:>6} {row['dense_tok_s']:>12.1f} {row['moe_tok_s']:>10.1f} "
            f"{row['moe_over_dense']:>9.2f}x"
        )
    return "\n".join(lines)
