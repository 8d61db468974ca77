"""Where one engine step's time goes on a GPU: engine phases and the top operators.

Usage: python bench/profile_steps.py MODEL_DIR [--load-format dummy] [--num-requests 64]
Prints per-phase milliseconds (schedule, model + sampling, postprocess) averaged over decode-heavy
steps, then torch.profiler's top operators by self CPU and by device time.
"""

from __future__ import annotations

import argparse
import time

import torch

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    engine = LLMEngine(
        EngineConfig(model=args.model, load_format=args.load_format, num_kv_blocks=4096)
    )
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for index in range(args.num_requests):
        prompt = [100 + (index * 7 + i) % 1000 for i in range(args.prompt_len)]
        engine.add_request(f"r{index}", prompt, params)
    while (
        any(r.num_output_tokens == 0 for r in engine._scheduler.running)
        or engine._scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()

    sync = engine._runner.synchronize
    phases = {"schedule": 0.0, "execute": 0.0, "update+postprocess": 0.0}
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        output = engine._scheduler.schedule()
        t1 = time.perf_counter()
        sampled = engine._runner.execute(output, engine._generators(output)).sampled
        sync()
        t2 = time.perf_counter()
        engine._scheduler.update(output)
        for token in sampled:
            engine._postprocess(token)
        t3 = time.perf_counter()
        phases["schedule"] += t1 - t0
        phases["execute"] += t2 - t1
        phases["update+postprocess"] += t3 - t2
    batch = len(engine._scheduler.running)
    print({k: round(v / args.steps * 1000, 2) for k, v in phases.items()}, "ms/step, batch", batch)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(10):
            engine.step()
        sync()
    table = profiler.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=20))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
