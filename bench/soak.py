"""`nori bench soak --minutes M`: sustained `bench serve` load on one cluster, sampled as it runs.

The seed's advice: trust no throughput before a 30-minute soak. The load runs in windows of
`--window-s` (each a `bench serve` run with its own seed, so no window finds the last one's
prompts in the prefix cache); after each window it samples the output throughput, the RSS of
every role process (/proc), and each worker's KV blocks from its /metrics. At the end, with the
cluster idle, every worker's free blocks must be back at their start (no leaked block), and
`check_invariants`-level bookkeeping shows in the workers' own figures. It writes JSON and a PNG.

Verdicts, as the issue states them: throughput in the last 5 minutes at least 95% of the first
5 (for runs under 15 minutes: the last third against the first), RSS growth under 5% per role
between the first window and the last, and no leaked block.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

from nori.bench.cluster_probe import (
    BenchCluster,
    idle_free_blocks,
    sample_cluster,
    start_bench_cluster,
    worker_metrics_addresses,
)
from nori.bench.serve.runner import run_benchmark_sync
from nori.bench.serve.settings import ServeBenchSettings
from nori.models.demo import resolve_model
from nori.sampling.tokenizer import Tokenizer

# The bounds.
MIN_THROUGHPUT_RATIO = 0.95
MAX_RSS_GROWTH = 0.05


@dataclass(frozen=True)
class SoakSettings:
    minutes: float = 30.0
    window_s: float = 30.0
    cluster: BenchCluster = field(default_factory=lambda: BenchCluster(name="soak"))
    workload: ServeBenchSettings = field(
        default_factory=lambda: ServeBenchSettings(
            dataset="random",
            random_input_len=128,
            random_output_len=128,
            prompt_format="token-ids",
            ignore_eos=True,
            max_concurrency=16,
            num_prompts=100_000,
        )
    )

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.window_s <= 0:
            raise ValueError("--minutes and --window-s must be positive")


def run_soak(settings: SoakSettings, log: Callable[[str], None]) -> dict[str, Any]:
    model_dir = resolve_model(settings.cluster.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    with ExitStack() as stack:
        cluster = start_bench_cluster(stack, settings.cluster)
        addresses = worker_metrics_addresses(cluster)
        start_free = idle_free_blocks(addresses)
        windows: list[dict[str, Any]] = []
        started = time.monotonic()
        deadline = started + settings.minutes * 60
        while time.monotonic() < deadline:
            cluster.check_alive()
            window_s = min(settings.window_s, max(1.0, deadline - time.monotonic()))
            workload = replace(
                settings.workload,
                base_url=cluster.url,
                model=model_dir.name,
                tokenizer=str(model_dir),
                duration_s=window_s,
                seed=settings.workload.seed + len(windows),
            )
            metrics = run_benchmark_sync(workload, tokenizer=tokenizer).metrics
            sample = sample_cluster(cluster, addresses)
            windows.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "output_throughput": metrics.output_throughput,
                    "completed": metrics.completed,
                    "failed": metrics.failed,
                    **sample,
                }
            )
            log(
                f"t={windows[-1]['t_s']:.0f}s: {metrics.output_throughput:.0f} output tok/s, "
                f"{metrics.completed} completed, {metrics.failed} failed; RSS MiB "
                + ", ".join(f"{k} {v:.0f}" for k, v in sample["rss_mib"].items())
            )
        end_free = idle_free_blocks(addresses)
        log("stopping the cluster...")
    return soak_report(settings, windows, start_free, end_free)


def soak_report(
    settings: SoakSettings,
    windows: list[dict[str, Any]],
    start_free: dict[str, int],
    end_free: dict[str, int],
) -> dict[str, Any]:
    """The verdicts over the sampled windows (pure: unit-tested on a fixed trace)."""
    if not windows:
        raise ValueError("the soak ran no window")
    total_s = windows[-1]["t_s"]
    span_s = 300.0 if settings.minutes >= 15 else total_s / 3
    first = [w for w in windows if w["t_s"] <= span_s] or windows[:1]
    last = [w for w in windows if w["t_s"] > total_s - span_s] or windows[-1:]

    def mean_throughput(group: list[dict[str, Any]]) -> float:
        return sum(w["output_throughput"] for w in group) / len(group)

    first_tps, last_tps = mean_throughput(first), mean_throughput(last)
    rss_growth = {
        name: (windows[-1]["rss_mib"][name] - mib) / mib if mib else 0.0
        for name, mib in windows[0]["rss_mib"].items()
    }
    leaked = {name: start_free[name] - end_free.get(name, 0) for name in start_free}
    failed = sum(w["failed"] for w in windows)
    return {
        "minutes": settings.minutes,
        "window_s": settings.window_s,
        "num_windows": len(windows),
        "completed": sum(w["completed"] for w in windows),
        "failed": failed,
        "first_span_output_throughput": first_tps,
        "last_span_output_throughput": last_tps,
        "span_s": span_s,
        "throughput_ratio": last_tps / first_tps if first_tps else None,
        "rss_growth": rss_growth,
        "leaked_blocks": leaked,
        "ok": {
            "throughput": bool(first_tps) and last_tps / first_tps >= MIN_THROUGHPUT_RATIO,
            "rss": all(growth < MAX_RSS_GROWTH for growth in rss_growth.values()),
            "blocks": not any(leaked.values()),
            "no_failures": failed == 0,
        },
        "windows": windows,
    }


def plot_soak(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = report["windows"]
    times = [w["t_s"] / 60 for w in windows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.plot(times, [w["output_throughput"] for w in windows], marker="o")
    top.set_ylabel("output tokens/s")
    top.set_title(
        f"nori bench soak: {report['minutes']:g} min, throughput last/first "
        f"{report['throughput_ratio']:.3f}, leaked blocks {sum(report['leaked_blocks'].values())}"
    )
    for name in windows[0]["rss_mib"]:
        bottom.plot(times, [w["rss_mib"][name] for w in windows], marker=".", label=name)
    bottom.set_ylabel("RSS (MiB)")
    bottom.set_xlabel("minutes")
    bottom.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
