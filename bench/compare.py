"""`nori bench compare`: the same `bench serve` workload on up to three clusters, on the same
CPUs, in turn: colocated (`nori up --colocated`), disaggregated (`nori up`: every prompt on a
prefill worker, `--disaggregation always`) and conditional (the same workers, the gateway
choosing per request whether a prompt goes to a prefill worker: `--disaggregation auto`).
`--sides` picks two or three of them.

- Every cluster runs on the same CPUs (this process's, or --cpus): the colocated worker on all
  of them, the workers of the other two with the default CPU plan (`nori.launch.cpu_plan`).
- All are started once and stay up for the whole comparison, and the runs alternate between
  them (c, d, a, c, d, a, ...), so that a slow spell of a shared machine hits every side. An
  idle cluster sleeps (its engine thread blocks, heartbeats once a second), and each side's runs
  have the others idle beside them, so what they cost is the same for every side; restarting
  would instead cost a cluster start per side and repeat.
- Since a cluster keeps its prefix cache between runs, every round of runs (one per side) uses
  its own seed (--seed + round number): every side of a round gets identical requests, and no
  run finds the prompts of an earlier one in the cache. Each run starts with `bench serve`'s
  warm-ups.
- Whatever happens (an error, Ctrl-C, SIGTERM), every cluster, and a private Redis started for
  them, are stopped on the way out.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from nori.bench.compare_report import (
    MEDIAN_BY,
    SHORT_CLASS,
    SIDES,
    Side,
    check_sides,
    compare_runs,
    median_index,
)
from nori.bench.serve.result import ServeBenchResult
from nori.bench.serve.runner import run_benchmark_sync
from nori.bench.serve.settings import ServeBenchSettings, json_number
from nori.cluster_auth import generate_secret
from nori.launch.cpu_plan import (
    CpuPlan,
    CpuRequest,
    format_cpu_list,
    parse_usable_cpus,
    plan_cpus,
)
from nori.launch.local_cluster import ClusterSpec, LocalCluster, free_port
from nori.launch.redis_server import redis_for_cluster
from nori.models.demo import resolve_model
from nori.sampling.tokenizer import Tokenizer
from nori.settings import DEFAULT_MAX_LOCAL_COMPUTE_S


@dataclass(frozen=True)
class CompareSettings:
    # The requests (base_url, model and tokenizer are set per cluster).
    workload: ServeBenchSettings = field(
        default_factory=lambda: ServeBenchSettings(dataset="mixed")
    )
    # A model folder or a built-in model (demo, small).
    model: str = "demo"
    # Which clusters are compared, in `SIDES` order.
    sides: tuple[Side, ...] = SIDES
    # The workers of the disaggregated and conditional sides.
    num_prefill: int = 1
    num_decode: int = 1
    # `nori serve` engine options for every worker of every side.
    worker_args: tuple[str, ...] = ()
    transport: str | None = None
    max_queued_prompt_tokens: int = 8192
    # The conditional side's gateway --max-local-compute-s.
    max_local_compute_s: float = DEFAULT_MAX_LOCAL_COMPUTE_S
    # The CPUs every side runs on (taskset syntax); None: this process's.
    cpus: str | None = None
    repeats: int = 3
    # --sweep: one comparison per request rate; empty: one at the workload's rate.
    request_rates: tuple[float, ...] = ()
    startup_timeout_s: float = 300.0
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if check_sides(self.sides) != self.sides:
            raise ValueError(f"sides must be two or three of {SIDES}, in that order")
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("--prefill and --decode must be at least 1")
        for rate in self.request_rates:
            if not 0 < rate < math.inf:
                raise ValueError(f"--sweep rates must be finite and > 0, got {rate}")

    @property
    def rates(self) -> tuple[float, ...]:
        return self.request_rates or (self.workload.request_rate,)


def parse_rates(text: str) -> tuple[float, ...]:
    """--sweep "1,2,4" -> (1.0, 2.0, 4.0)."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--sweep {text!r}: expected request rates like 1,2,4") from None
    if not rates:
        raise ValueError("--sweep needs at least one request rate")
    return rates


def cpu_plans(usable: frozenset[int], settings: CompareSettings) -> dict[str, CpuPlan]:
    """The colocated side on all the CPUs, the disaggregated and conditional sides (the same
    workers) on the default plan."""
    split = plan_cpus(
        usable, CpuRequest(num_prefill=settings.num_prefill, num_decode=settings.num_decode)
    )
    whole = plan_cpus(usable, CpuRequest(colocated=True))
    return {side: whole if side == "colocated" else split for side in settings.sides}


def usable_cpus(cpus: str | None) -> frozenset[int]:
    """--cpus, checked against this process's CPUs; all of those without it."""
    own = frozenset(os.sched_getaffinity(0))
    return parse_usable_cpus(cpus, "--cpus", own) or own


@dataclass(frozen=True)
class ComparePoint:
    request_rate: float
    # Per side (in `SIDES` order), its runs in the order they ran.
    runs: Mapping[str, tuple[ServeBenchResult, ...]]

    def report(self) -> dict[str, object]:
        """The comparison's JSON (`compare_runs`)."""
        runs = {side: [run.to_dict() for run in side_runs] for side, side_runs in self.runs.items()}
        return compare_runs(runs, json_number(self.request_rate))

    def median_runs(self) -> dict[str, ServeBenchResult]:
        """Each side's reported run (what `--plot` draws)."""
        return {
            side: side_runs[median_index([run_headline(run) for run in side_runs])]
            for side, side_runs in self.runs.items()
        }


@dataclass(frozen=True)
class CompareOutcome:
    cpus: frozenset[int]
    plans: Mapping[str, CpuPlan]
    points: tuple[ComparePoint, ...]
    repeats: int
    # --sweep: the JSON holds a list of points; else the one point's figures at the top.
    sweep: bool

    def report(self) -> dict[str, object]:
        report: dict[str, object] = {
            "cpus": format_cpu_list(self.cpus),
            "cpu_plans": {side: plan.to_dict() for side, plan in self.plans.items()},
            "repeats": self.repeats,
        }
        points = self.point_reports()
        report.update({"sweep": points} if self.sweep else points[0])
        return report

    def point_reports(self) -> list[dict[str, object]]:
        return [point.report() for point in self.points]


def run_headline(result: ServeBenchResult) -> float:
    """The figure the median run is chosen by."""
    return float(getattr(result.metrics, MEDIAN_BY))


def run_compare(settings: CompareSettings, log: Callable[[str], None]) -> CompareOutcome:
    """Starts every side's cluster, runs the alternating repeats for every rate, stops them."""
    usable = usable_cpus(settings.cpus)
    plans = cpu_plans(usable, settings)
    model_dir = resolve_model(settings.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    with ExitStack() as stack:
        redis_url, redis_server = redis_for_cluster()
        if redis_server is not None:
            stack.callback(redis_server.stop)
        clusters = {}
        for side in settings.sides:
            log(f"starting the {side} cluster:")
            for line in plans[side].describe():
                log(f"  {line}")
            spec = _cluster_spec(settings, side, redis_url, str(model_dir), plans[side])
            cluster = stack.enter_context(LocalCluster(spec))
            cluster.start(timeout_s=settings.startup_timeout_s)
            clusters[side] = cluster
        points = []
        for point_index, rate in enumerate(settings.rates):
            runs: dict[str, list[ServeBenchResult]] = {side: [] for side in settings.sides}
            for repeat in range(settings.repeats):
                seed = settings.workload.seed + point_index * settings.repeats + repeat
                for side in settings.sides:
                    cluster = clusters[side]
                    cluster.check_alive()
                    workload = replace(
                        settings.workload,
                        base_url=cluster.url,
                        model=model_dir.name,
                        tokenizer=str(model_dir),
                        request_rate=rate,
                        seed=seed,
                    )
                    result = run_benchmark_sync(workload, tokenizer=tokenizer)
                    runs[side].append(result)
                    log(_run_line(side, rate, repeat, settings.repeats, result))
            points.append(
                ComparePoint(rate, {side: tuple(side_runs) for side, side_runs in runs.items()})
            )
        log("stopping the clusters...")
    return CompareOutcome(
        usable, plans, tuple(points), settings.repeats, sweep=bool(settings.request_rates)
    )


def _cluster_spec(
    settings: CompareSettings, side: Side, redis_url: str, model: str, plan: CpuPlan
) -> ClusterSpec:
    log_dir = settings.log_dir / side if settings.log_dir is not None else None
    return ClusterSpec(
        redis_url=redis_url,
        model=model,
        num_prefill=settings.num_prefill,
        num_decode=settings.num_decode,
        colocated=side == "colocated",
        # The gateway's choice of where prompts are computed (a colocated cluster has no choice).
        disaggregation="auto" if side == "conditional" else "always",
        max_local_compute_s=settings.max_local_compute_s,
        port=free_port(),
        namespace=f"compare-{uuid.uuid4().hex[:8]}-{side}",
        served_model_name=Path(model).name,
        transport=settings.transport,
        max_queued_prompt_tokens=settings.max_queued_prompt_tokens,
        worker_args=settings.worker_args,
        log_dir=log_dir,
        cpu_plan=plan,
        # Authenticated as `nori up` runs it: the benchmark pays what users pay.
        cluster_secret=generate_secret(),
    )


def _run_line(side: str, rate: float, repeat: int, repeats: int, result: ServeBenchResult) -> str:
    metrics = result.metrics
    itl = result.class_metrics.get(SHORT_CLASS, metrics).itl
    p99 = dict(itl.percentiles).get(99)
    return (
        f"rate {json_number(rate)} req/s, run {repeat + 1}/{repeats}, {side}: "
        f"{run_headline(result):.2f} output tok/s, "
        f"{metrics.effective_throughput:.2f} effective tok/s, p99 ITL "
        + ("n/a" if p99 is None else f"{p99:.1f} ms")
        + f", {metrics.failed} failed"
    )
