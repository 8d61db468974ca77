"""`nori bench moe-layer`: one mixture-of-experts layer's experts on CPU, the PyTorch reference
loop (`fused_experts_reference`) against the C++ kernel (`fused_experts_cpu`), by batch size.

The shape defaults to the "small" preset's MoE (hidden 512, 8 experts, top-2, expert
intermediate 688). By default (`weight_order="each-best"`) each path gets the weights in the
layout it runs fastest on: the reference loop PyTorch's [out, in] rows (as transformers stores
them), the C++ kernel the panels of 16 outputs the model stores on CPU (`pack_expert_panels`).
`"in-out"` and `"out-in"` give both paths the same tensors (the reference is much slower on
[in, out] bfloat16 weights; "out-in" times the C++ kernel with its copy to [in, out]); `"panels"`
gives the reference [out, in] as well (it cannot read panels). On a shared or
small machine `threads=1` gives steadier figures than torch's default thread count.

Per batch size and dtype both paths run on the same random inputs and routing, back to back and
alternating (reference, C++; then C++, reference) for `rounds` rounds; each round times
`iterations` calls after a warm-up, and each figure is the median over the rounds, as is the
speed-up (the median of the rounds' ratios, each taken back to back). The issue's target: the
C++ layer at least 3x the reference at batch 16 and 64.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from nori.kernels.fused_moe import (
    fused_experts_cpu,
    fused_experts_reference,
    pack_expert_panels,
)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Each expert's matrices as stored: "in-out" has the output dimension contiguous
# (`w.transpose(1, 2).contiguous().transpose(1, 2)`, the C++ kernel's streamed route and the
# order the model should use), "out-in" is PyTorch's [out, in] row-major (the C++ kernel copies it
# to [in, out] first).
# "each-best" (and "panels"): the reference on "out-in", the C++ kernel on panels.
WeightOrder = Literal["each-best", "panels", "in-out", "out-in"]


@dataclass(frozen=True)
class MoeLayerShape:
    hidden_size: int = 512
    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 688


@dataclass(frozen=True)
class MoeLayerBenchSettings:
    shape: MoeLayerShape = MoeLayerShape()
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    rounds: int = 3
    # Timed calls per round (after one warm-up call per path).
    iterations: int = 20
    weight_order: WeightOrder = "each-best"
    # torch's intra-op threads during the run (None: as they are); restored afterwards.
    threads: int | None = None
    seed: int = 0


def _layer_inputs(
    shape: MoeLayerShape, tokens: int, dtype: torch.dtype, weight_order: WeightOrder, seed: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, experts = shape.hidden_size, shape.intermediate_size, shape.num_experts
    """(reference's arguments, the C++ kernel's arguments): the same values, each path's
    weights in the memory order `weight_order` gives it."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter, experts = shape.hidden_size, shape.intermediate_size, shape.num_experts
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=generator) / inter**0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = logits.softmax(dim=-1).topk(shape.top_k, dim=-1)

    def in_out(w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2).contiguous().transpose(1, 2)

    if weight_order in ("each-best", "panels"):
        reference_w = (w13, w2)
        fused_w = (pack_expert_panels(w13), pack_expert_panels(w2))
    elif weight_order == "in-out":
        reference_w = fused_w = (in_out(w13), in_out(w2))
    else:
        reference_w = fused_w = (w13, w2)
    return (x, *reference_w, weights, ids), (x, *fused_w, weights, ids)


def _seconds_per_call(call: Callable[[], torch.Tensor], iterations: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - start) / iterations


def run_moe_layer_benchmark(
    settings: MoeLayerBenchSettings = MoeLayerBenchSettings(), show: bool = True
) -> dict[str, Any]:
    """Times both paths per (dtype, batch size); returns the report (and prints its table when
    `show`). Each row: the median microseconds per call of each path and the median speed-up,
    plus the largest difference between the two outputs (a sanity check, not a tolerance)."""
    if min(settings.batch_sizes) < 1 or settings.rounds < 1 or settings.iterations < 1:
        raise ValueError("batch sizes, rounds and iterations must be >= 1")
    unknown = [name for name in settings.dtypes if name not in DTYPES]
    if unknown:
        raise ValueError(f"dtypes must be among {sorted(DTYPES)}, got {unknown}")
    if settings.threads is not None and settings.threads < 1:
        raise ValueError("threads must be >= 1")
    rows: list[dict[str, Any]] = []
    threads_before = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    try:
        threads = torch.get_num_threads()
        with torch.inference_mode():
            for dtype_name in settings.dtypes:
                for tokens in settings.batch_sizes:
                    args = _layer_inputs(
                        settings.shape,
                        tokens,
                        DTYPES[dtype_name],
                        settings.weight_order,
                        settings.seed,
                    )
                    rows.append(_time_both(args, dtype_name, tokens, settings))
    finally:
        torch.set_num_threads(threads_before)
    report = {
        "benchmark": "moe-layer",
        "cpu": cpu_model(),
        "torch_threads": threads,
        "settings": asdict(settings),
        "results": rows,
    }
    if show:
        print(format_report(report))
    return report


def _time_both(
    args: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    dtype_name: str,
    tokens: int,
    settings: MoeLayerBenchSettings,
) -> dict[str, Any]:
    reference_args, fused_args = args

    def reference() -> torch.Tensor:
        return fused_experts_reference(*reference_args)

    def fused() -> torch.Tensor:
        return fused_experts_cpu(*fused_args)

    reference_s: list[float] = []
    fused_s: list[float] = []
    for round_index in range(settings.rounds):
        order = (reference, fused) if round_index % 2 == 0 else (fused, reference)
        for call in order:
            seconds = _seconds_per_call(call, settings.iterations)
            (reference_s if call is reference else fused_s).append(seconds)
    difference = float((fused().float() - reference().float()).abs().max())
    return {
        "dtype": dtype_name,
        "tokens": tokens,
        "reference_us": statistics.median(reference_s) * 1e6,
        "fused_cpu_us": statistics.median(fused_s) * 1e6,
        "speedup": statistics.median(r / f for r, f in zip(reference_s, fused_s, strict=True)),
        "max_abs_difference": difference,
    }


def cpu_model() -> str:
    """This host's CPU model, as /proc/cpuinfo names it (stated beside every figure)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_report(report: dict[str, Any]) -> str:
    shape = report["settings"]["shape"]
    lines = [
        f"MoE layer on CPU ({report['cpu']}, {report['torch_threads']} threads): hidden "
        f"{shape['hidden_size']}, {shape['num_experts']} experts, top-{shape['top_k']}, "
        f"intermediate {shape['intermediate_size']}"
        + f", weights {report['settings']['weight_order']}",
        f"{'dtype':<9} {'tokens':>6} {'reference us':>13} {'C++ us':>10} {'speed-up':>9}",
    ]
    for row in report["results"]:
        lines.append(
            f"{row['dtype']:<9} {row['tokens']:>6} {row['reference_us']:>13.1f} "
            f"{row['fused_cpu_us']:>10.1f} {row['speedup']:>8.2f}x"
        )
    return "\n".join(lines)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--batch-sizes takes integers like 1,16,64, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes must be >= 1")
    return sizes


def dtypes_from_arg(text: str) -> tuple[str, ...]:
    """`--dtype float32|bfloat16|both`."""
    return tuple(DTYPES) if text == "both" else (text,)
