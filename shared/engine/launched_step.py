"""A step in flight: its schedule, its sampled tokens (pending in their requests,
`Request.num_pending_tokens`, from launch to `resolve`) and its duration."""

from __future__ import annotations

import time

import torch

from nori.engine.scheduler import SchedulerOutput
from nori.engine.step_sampling import SampledStep, SampledTokens


class LaunchedStep:
    def __init__(self, output: SchedulerOutput, device: torch.device) -> None:
        """Starts the clock: host time on CPU, where a step runs in `execute`; on CUDA the
        device's time between two events, as the host moves on before the step ends."""
        self.output = output
        self.sampled: SampledStep | None = None
        self._started = time.perf_counter()
        self._seconds = 0.0
        self._events = None
        if device.type == "cuda":
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self._events[0].record()

    def launched(self, sampled: SampledStep | None) -> None:
        """The step's work is queued; its sampled requests' tokens are pending."""
        self._seconds = time.perf_counter() - self._started
        if self._events is not None:
            self._events[1].record()
        self.sampled = sampled
        for row, request in enumerate([] if sampled is None else sampled.requests):
            request.num_pending_tokens += 1
            request.pending_row = row

    def defers(self, speculating: bool) -> bool:
        """Whether the tokens may stay pending through the next step: plain rows only (no
        verification), no KV hand-off after them, and no request whose next sampling reads its
        output so far (penalties; min_tokens, which masks EOS by the output's length)."""
        if speculating or self.sampled is None or self.sampled.tokens is None:
            return False
        return all(
            not request.prefill_only
            and not request.sampling_params.has_penalties
            and request.num_output_tokens > request.sampling_params.min_tokens
            for request in self.sampled.requests
        )

    def resolve(self) -> list[SampledTokens]:
        """The tokens on the host (waits for the device); they are no longer pending."""
        if self.sampled is None:
            return []
        for request in self.sampled.requests:
            request.num_pending_tokens -= 1
        return self.sampled.resolve()

    def seconds(self) -> float:
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0
