"""Conditional disaggregation: per request, whether its prompt is computed on a prefill worker
("prefill": its KV blocks then move to the decode worker) or on the decode worker ("decode").

`choose_path` is pure: the cheaper path in request-seconds (the wait for token one plus the delay
on the decode worker's streams), from the workers' step-cost fits, queued prompt tokens and this
gateway's `PrefillPathMeter`. Prompts over `max_local_compute_s` of decode-worker compute, and all
prompts until every figure is known, go to a prefill worker. Cost model: docs/architecture.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from nori.settings import DEFAULT_MAX_LOCAL_COMPUTE_S, DisaggregationMode
from nori.state.registry import WorkerInfo

PromptPath = Literal["prefill", "decode"]
DecisionReason = Literal[
    "mode",  # --disaggregation always / never
    "no_prefill_worker",
    "not_measured",  # no step-cost fit yet, or the prefill path unmeasured
    "cheaper_on_decode",
    "cheaper_on_prefill",
    "local_cap",  # cheaper on the decode worker, but over max_local_compute_s there
]

# Weight of a new measurement of the prefill path in its running averages.
_SMOOTHING = 0.05


@dataclass(frozen=True)
class PathQueues:
    """What waits on the two workers a request could use, as this gateway counts it."""

    decode_running: int
    # Prompt tokens sent to be computed and not yet seen computed, on each worker.
    decode_pending_tokens: int
    prefill_pending_tokens: int

    @classmethod
    def counted(
        cls,
        decode: WorkerInfo,
        prefill: WorkerInfo | None,
        in_flight: Mapping[str, int],
        pending_tokens: Mapping[str, int],
    ) -> PathQueues:
        """From the registry's figures and this gateway's counts per worker (`Ledger`)."""
        return cls(
            decode_running=max(decode.num_running, in_flight.get(decode.worker_id, 0)),
            decode_pending_tokens=pending_tokens.get(decode.worker_id, 0),
            prefill_pending_tokens=pending_tokens.get(prefill.worker_id, 0) if prefill else 0,
        )


@dataclass(frozen=True)
class PathChoice:
    """Where a prompt is computed, why, and the figures the choice was made on."""

    path: PromptPath
    reason: DecisionReason
    num_prompt_tokens: int
    uncached_tokens: int  # not in the chosen prefill worker's prefix cache
    decode_cost_s: float | None = None
    prefill_cost_s: float | None = None
    # Where both paths cost the same now (None: not measured; inf: decode is always cheaper).
    threshold_tokens: float | None = None

    def span_attributes(self) -> dict[str, str | int | float]:
        attributes: dict[str, str | int | float] = {
            "nori.disaggregation.path": self.path,
            "nori.disaggregation.reason": self.reason,
            "nori.disaggregation.uncached_tokens": self.uncached_tokens,
        }
        for name, value in (
            ("decode_cost_s", self.decode_cost_s),
            ("prefill_cost_s", self.prefill_cost_s),
            ("threshold_tokens", self.threshold_tokens),
        ):
            if value is not None:
                attributes[f"nori.disaggregation.{name}"] = round(value, 6)
        return attributes


@dataclass(frozen=True)
class PrefillPathFigures:
    """The prefill path's measured hop and transfer (`fixed + per_token * tokens`), or None."""

    hop_s: float | None = None
    transfer_fixed_s: float | None = None
    transfer_s_per_token: float | None = None

    @property
    def complete(self) -> bool:
        return None not in (self.hop_s, self.transfer_fixed_s, self.transfer_s_per_token)


@dataclass
class PrefillPathMeter:
    """The prefill path as this gateway saw it: the hop as an exponential average, the transfer
    time as a least-squares line in the prompt's length, older requests weighing less."""

    hop_s: float | None = None
    # Σw, Σw·tokens, Σw·tokens², Σw·seconds, Σw·tokens·seconds over the transfers.
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def observe(
        self,
        num_prompt_tokens: int,
        first_token_wait_s: float,
        prefill_seconds: float,
        transfer_seconds: float,
    ) -> None:
        """One request served by the prefill path, and what its prefill worker reported."""
        self.hop_s = _average(
            self.hop_s, max(first_token_wait_s - prefill_seconds - transfer_seconds, 0.0)
        )
        if transfer_seconds <= 0 or num_prompt_tokens <= 0:
            return  # finished with token one: nothing was sent
        x, y = float(num_prompt_tokens), transfer_seconds
        keep = 1 - _SMOOTHING
        n, sx, sxx, sy, sxy = (keep * value for value in self._sums)
        self._sums = (n + 1, sx + x, sxx + x * x, sy + y, sxy + x * y)

    def figures(self) -> PrefillPathFigures:
        n, sx, sxx, sy, sxy = self._sums
        if n == 0:
            return PrefillPathFigures(self.hop_s)
        spread = n * sxx - sx * sx
        if spread <= 1e-9 * n * sxx:
            # One prompt length so far: all of it per token (the dearer guess for longer prompts).
            return PrefillPathFigures(self.hop_s, 0.0, sy / sx)
        slope = max((n * sxy - sx * sy) / spread, 0.0)
        fixed = max((sy - slope * sx) / n, 0.0)
        return PrefillPathFigures(self.hop_s, fixed, slope)


def _average(current: float | None, sample: float) -> float:
    return sample if current is None else (1 - _SMOOTHING) * current + _SMOOTHING * sample


def choose_path(
    mode: DisaggregationMode,
    num_prompt_tokens: int,
    decode: WorkerInfo,
    prefill: WorkerInfo | None,
    cached_on_prefill: int,
    queues: PathQueues,
    measured: PrefillPathFigures,
    max_local_compute_s: float = DEFAULT_MAX_LOCAL_COMPUTE_S,
) -> PathChoice:
    """Where this prompt is computed (see the module doc). Pure."""
    uncached = max(num_prompt_tokens - min(cached_on_prefill, num_prompt_tokens), 1)
    if mode == "always":
        return PathChoice("prefill", "mode", num_prompt_tokens, uncached)
    if mode == "never":
        return PathChoice("decode", "mode", num_prompt_tokens, num_prompt_tokens)
    if prefill is None:
        return PathChoice("decode", "no_prefill_worker", num_prompt_tokens, num_prompt_tokens)
    # A decode worker that has computed no prompt yet is taken to cost what the prefill one does.
    decode_per_token = decode.step_per_token_s or prefill.step_per_token_s
    if (
        decode_per_token <= 0
        or prefill.step_per_token_s <= 0
        or decode.step_fixed_s + decode.step_per_row_s <= 0
        or not measured.complete
    ):
        return PathChoice("prefill", "not_measured", num_prompt_tokens, uncached)
    assert measured.hop_s is not None and measured.transfer_fixed_s is not None
    assert measured.transfer_s_per_token is not None
    running = queues.decode_running
    decode_step_s = decode.step_fixed_s + decode.step_per_row_s * running
    chunking = 2.0 if running > 0 else 1.0
    decode_fixed = queues.decode_pending_tokens * decode_per_token * chunking + decode_step_s
    decode_slope = decode_per_token * (chunking + running)
    prefill_fixed = (
        measured.hop_s
        + measured.transfer_fixed_s
        + prefill.step_fixed_s
        + queues.prefill_pending_tokens * prefill.step_per_token_s
    )
    prefill_slope = measured.transfer_s_per_token * (1 + running)
    decode_cost = decode_fixed + decode_slope * num_prompt_tokens
    prefill_cost = (
        prefill_fixed + prefill.step_per_token_s * uncached + prefill_slope * num_prompt_tokens
    )
    slope_gap = decode_slope - (prefill.step_per_token_s + prefill_slope)
    threshold = (prefill_fixed - decode_fixed) / slope_gap if slope_gap > 0 else math.inf
    threshold = max(threshold, 0.0)
    costs = {
        "decode_cost_s": decode_cost,
        "prefill_cost_s": prefill_cost,
        "threshold_tokens": threshold,
    }
    if decode_cost >= prefill_cost:
        return PathChoice("prefill", "cheaper_on_prefill", num_prompt_tokens, uncached, **costs)
    if num_prompt_tokens * decode_per_token > max_local_compute_s:
        return PathChoice("prefill", "local_cap", num_prompt_tokens, uncached, **costs)
    return PathChoice("decode", "cheaper_on_decode", num_prompt_tokens, num_prompt_tokens, **costs)


class DisaggregationPolicy:
    """The mode, the prefill path's meter, and the decision metrics (in a registry of its own)."""

    def __init__(
        self, mode: DisaggregationMode, max_local_compute_s: float = DEFAULT_MAX_LOCAL_COMPUTE_S
    ) -> None:
        if max_local_compute_s <= 0:
            raise ValueError(
                f"the local prompt compute cap must be positive, got {max_local_compute_s}"
            )
        self.mode = mode
        self.max_local_compute_s = max_local_compute_s
        self.meter = PrefillPathMeter()
        self.registry = CollectorRegistry(auto_describe=True)
        self._decisions = Counter(
            "nori_gateway_disaggregation_decisions",
            "Where prompts were computed (prefill worker or decode worker), and why.",
            ["path", "reason"],
            registry=self.registry,
        )
        self._threshold = Gauge(
            "nori_gateway_disaggregation_threshold_tokens",
            "The prompt length at which both paths cost the same, at the last auto decision "
            "(+Inf: the decode worker is cheaper at any length).",
            registry=self.registry,
        )
        self._hop = Gauge(
            "nori_gateway_prefill_hop_seconds",
            "The prefill path's own overhead (reservation and calls), as measured.",
            registry=self.registry,
        )
        self._transfer_per_token = Gauge(
            "nori_gateway_kv_transfer_seconds_per_token",
            "KV transfer time from prefill to decode workers per prompt token, as measured.",
            registry=self.registry,
        )

    def choose(
        self,
        num_prompt_tokens: int,
        decode: WorkerInfo,
        prefill: WorkerInfo | None,
        cached_on_prefill: int,
        queues: PathQueues,
    ) -> PathChoice:
        choice = choose_path(
            self.mode,
            num_prompt_tokens,
            decode,
            prefill,
            cached_on_prefill,
            queues,
            self.meter.figures(),
            self.max_local_compute_s,
        )
        self._decisions.labels(choice.path, choice.reason).inc()
        if choice.threshold_tokens is not None:
            self._threshold.set(choice.threshold_tokens)
        return choice

    def observe_prefill_path(
        self,
        num_prompt_tokens: int,
        first_token_wait_s: float,
        prefill_seconds: float,
        transfer_seconds: float,
    ) -> None:
        self.meter.observe(num_prompt_tokens, first_token_wait_s, prefill_seconds, transfer_seconds)
        figures = self.meter.figures()
        if figures.hop_s is not None:
            self._hop.set(figures.hop_s)
        if figures.transfer_s_per_token is not None:
            self._transfer_per_token.set(figures.transfer_s_per_token)

    def decision_count(self, path: PromptPath, reason: DecisionReason) -> float:
        value = self.registry.get_sample_value(
            "nori_gateway_disaggregation_decisions_total", {"path": path, "reason": reason}
        )
        return value or 0.0

    def metrics_text(self) -> str:
        return generate_latest(self.registry).decode()
