"""`nori bench step-overhead`: the engine's host time per decode step outside the model's forward.

For each batch size: `batch` requests of `prompt_len` tokens (greedy, `ignore_eos`) are added and
stepped until every one decodes; then `repeats` windows of `steps` pure decode steps are timed.
Per window: the step's wall time, the forward's (the model and its logits, the device waited for
on both sides) and, outside it, the scheduler's `schedule`, the rest of `execute` (step inputs and
sampling) and what follows (update, stop checks, outputs). Reported: the median window's
milliseconds per step, and on a GPU the step's floor (weights and KV read at the measured copy
bandwidth). The default model is the `tiny` preset, where the forward is small beside
the host's work, as an 8B model's is on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.model_runner import ModelRunner, StepResult
from nori.engine.scheduler import Scheduler, SchedulerOutput
from nori.engine.step_sampling import SampledStep
from nori.models.demo import default_cache_dir, ensure_builtin_checkpoint, resolve_model
from nori.sampling.params import SamplingParams

DEFAULT_PRESET = "tiny"


class _Clock:
    """Seconds spent in each timed phase since the last `reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def reset(self) -> None:
        self.seconds = {}


def _timed_classes(clock: _Clock) -> tuple[type[Scheduler], type[ModelRunner]]:
    class TimedScheduler(Scheduler):
        def schedule(self, spec_lengths: Mapping[str, int] | None = None) -> SchedulerOutput:
            started = time.perf_counter()
            output = super().schedule(spec_lengths)
            clock.add("schedule", time.perf_counter() - started)
            return output

    class TimedRunner(ModelRunner):
        def execute(
            self,
            output: SchedulerOutput,
            generators: Mapping[str, torch.Generator],
            previous: SampledStep | None = None,
        ) -> StepResult:
            started = time.perf_counter()
            result = super().execute(output, generators, previous)
            clock.add("execute", time.perf_counter() - started)
            return result

        def _forward(
            self,
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            metadata: AttentionMetadata,
            logits_rows: Sequence[torch.Tensor],
        ) -> list[torch.Tensor]:
            self.synchronize()
            started = time.perf_counter()
            logits = super()._forward(input_ids, positions, metadata, logits_rows)
            self.synchronize()
            clock.add("forward", time.perf_counter() - started)
            return logits

    return TimedScheduler, TimedRunner


@dataclass(frozen=True)
class StepOverhead:
    """Milliseconds per decode step at one batch size (the median window's)."""

    batch: int
    step_ms: float
    forward_ms: float
    host_ms: float  # step_ms - forward_ms
    schedule_ms: float
    inputs_and_sampling_ms: float
    update_and_outputs_ms: float
    # On a GPU: the step's floor, its weights and KV context read at the card's measured copy
    # bandwidth (None elsewhere).
    floor_ms: float | None = None
    cuda_graphs: bool = False  # pure decode steps replayed CUDA graphs


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), the best of `repeats`."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


def step_floor_ms(runner: ModelRunner, context_tokens: int, bandwidth: float) -> float:
    """Milliseconds to read the weights once and `context_tokens` tokens' K/V at `bandwidth`."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.kv_cache_bytes / (runner.kv_cache.num_blocks * runner.config.block_size)
    return (weights + context_tokens * kv_per_token) / bandwidth * 1000


def measure(
    config: EngineConfig, batch: int, prompt_len: int, steps: int, repeats: int
) -> StepOverhead:
    clock = _Clock()
    scheduler_class, runner_class = _timed_classes(clock)
    config = replace(config, max_num_seqs=max(batch, config.max_num_seqs))
    runner = runner_class(config, resolve_model(config.model))
    engine = LLMEngine(config, runner=runner, scheduler_class=scheduler_class)
    params = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    for index in range(batch):
        prompt = [(index * 7 + i) % (vocab - 1) + 1 for i in range(prompt_len)]
        engine.add_request(f"r{index}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(output.request_id for output in engine.step())
    for _ in range(3):
        engine.step()
    windows = []
    for _ in range(repeats):
        clock.reset()
        window_started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        runner.synchronize()
        total = time.perf_counter() - window_started
        s = clock.seconds
        windows.append(
            StepOverhead(
                batch=batch,
                step_ms=total,
                forward_ms=s["forward"],
                host_ms=total - s["forward"],
                schedule_ms=s["schedule"],
                inputs_and_sampling_ms=s["execute"] - s["forward"],
                update_and_outputs_ms=total - s["execute"] - s["schedule"],
            )
        )
    if engine.load().num_running != batch:
        raise RuntimeError(f"the batch shrank below {batch} rows (KV pool too small?)")
    floor = None
    if runner.device.type == "cuda":
        # The context each row read, on average over the timed windows.
        context = prompt_len + 4 + repeats * steps // 2
        floor = step_floor_ms(runner, batch * context, copy_bandwidth(runner.device))
    engine.close()
    median = sorted(windows, key=lambda w: w.host_ms)[len(windows) // 2]
    per_step = {
        k: v / steps * 1000
        for k, v in asdict(median).items()
        if k not in ("batch", "floor_ms", "cuda_graphs")
    }
    graphs = runner.graphs is not None
    return StepOverhead(batch=batch, floor_ms=floor, cuda_graphs=graphs, **per_step)


def default_config() -> EngineConfig:
    """The tiny preset (written on first use), with room for 256 rows of any short prompt."""
    model = ensure_builtin_checkpoint(default_cache_dir(), DEFAULT_PRESET)
    return EngineConfig(model=str(model), num_kv_blocks=4096)


def run_step_overhead(
    config: EngineConfig, batch_sizes: Sequence[int], prompt_len: int, steps: int, repeats: int
) -> dict[str, Any]:
    results = [measure(config, b, prompt_len, steps, repeats) for b in batch_sizes]
    return {
        "model": config.model,
        "device": config.device,
        "prompt_len": prompt_len,
        "steps": steps,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "results": [asdict(r) for r in results],
    }


def format_report(report: Mapping[str, Any]) -> str:
    lines = [
        f"model {report['model']}, {report['steps']} decode steps per window, median of "
        f"{report['repeats']} windows, {report['torch_threads']} torch threads (ms per step)",
        f"{'batch':>6} {'step':>8} {'forward':>8} {'host':>8} {'schedule':>9} "
        f"{'inputs+sampling':>16} {'update+outputs':>15} {'floor':>7}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['batch']:>6} {r['step_ms']:>8.2f} {r['forward_ms']:>8.2f} {r['host_ms']:>8.2f} "
            f"{r['schedule_ms']:>9.2f} {r['inputs_and_sampling_ms']:>16.2f} "
            f"{r['update_and_outputs_ms']:>15.2f} "
            + ("" if r["floor_ms"] is None else f"{r['floor_ms']:>7.2f}")
        )
    return "\n".join(lines)
