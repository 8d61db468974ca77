"""Where one engine step's time goes on a GPU: engine phases and the top operators.

Usage: python bench/profile_steps.py MODEL_DIR [--load-format dummy] [--num-requests 64]
Prints per-phase milliseconds (schedule, model + sampling, update + postprocess) averaged over
decode-heavy steps (timed through a Scheduler and a ModelRunner subclass), then torch.profiler's top operators by self CPU and by device time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from typing import ClassVar

import torch

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.model_runner import ModelRunner, StepResult
from nori.engine.scheduler import Scheduler, SchedulerOutput
from nori.engine.step_sampling import SampledStep
from nori.models.demo import resolve_model
from nori.sampling.params import SamplingParams


class TimedScheduler(Scheduler):
    """Adds up the seconds spent in `schedule` (of every instance: the engine makes one)."""

    total_s: ClassVar[float] = 0.0

    def schedule(self, spec_lengths: Mapping[str, int] | None = None) -> SchedulerOutput:
        started = time.perf_counter()
        output = super().schedule(spec_lengths)
        TimedScheduler.total_s += time.perf_counter() - started
        return output


class TimedRunner(ModelRunner):
    """Adds up the seconds of `execute`, the device waited for on both sides."""

    seconds = 0.0

    def execute(
        self,
        output: SchedulerOutput,
        generators: Mapping[str, torch.Generator],
        previous: SampledStep | None = None,
    ) -> StepResult:
        self.synchronize()
        started = time.perf_counter()
        result = super().execute(output, generators, previous)
        self.synchronize()
        self.seconds += time.perf_counter() - started
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    config = EngineConfig(model=args.model, load_format=args.load_format, num_kv_blocks=4096)
    runner = TimedRunner(config, resolve_model(config.model))  # ignore_eos: no EOS masking
    engine = LLMEngine(config, runner=runner, scheduler_class=TimedScheduler)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for index in range(args.num_requests):
        prompt = [100 + (index * 7 + i) % 1000 for i in range(args.prompt_len)]
        engine.add_request(f"r{index}", prompt, params)
    started: set[str] = set()
    while len(started) < args.num_requests:  # every request decoding
        started.update(output.request_id for output in engine.step())
    for _ in range(5):
        engine.step()

    schedule_s, execute_s, total_s = TimedScheduler.total_s, runner.seconds, 0.0
    for _ in range(args.steps):
        runner.synchronize()
        step_started = time.perf_counter()
        engine.step()
        runner.synchronize()
        total_s += time.perf_counter() - step_started
    schedule_s = TimedScheduler.total_s - schedule_s
    execute_s = runner.seconds - execute_s
    phases = {
        "schedule": schedule_s,
        "execute": execute_s,
        "update+postprocess": total_s - schedule_s - execute_s,
    }
    batch = engine.load().num_running
    print({k: round(v / args.steps * 1000, 2) for k, v in phases.items()}, "ms/step, batch", batch)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(10):
            engine.step()
        runner.synchronize()
    table = profiler.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=20))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
