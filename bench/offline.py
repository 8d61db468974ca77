"""Offline throughput: continuous batching, and optionally static batching on the same prompts.

Static batching is the classic scheme of a [batch, max_len] tensor (bench/static_batching.py: a
batch waits for its longest member, its prompts are padded to the longest, every member reserves
its rectangle up front, and a member that finishes early keeps computing its row). Both runs
share the loaded model, the kernels, the KV pool, max_num_seqs and the token budget; each starts
with an empty prefix cache (static batching has none).

With repeats, the policies take turns (continuous, static, continuous, ...), so that a slow
spell of a shared machine hits both, and each policy's median run is reported.

A mixture-of-experts model's load balance comes with the continuous run reported: per routed
layer the tokens each expert received and max/mean (1.0 = even), and their sum, checked against
the tokens the engine forwarded x top_k x routed layers (`moe_*` fields).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Literal

from nori.bench.static_batching import StaticBatchScheduler
from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.model_runner import ModelRunner
from nori.engine.outputs import ExpertRoutingCounts, StepOutput, expert_imbalance
from nori.engine.scheduler import Scheduler
from nori.models.demo import resolve_model
from nori.sampling.params import SamplingParams

SchedulingPolicy = Literal["continuous", "static"]


@dataclass(frozen=True)
class OfflineWorkload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class RunResult:
    policy: SchedulingPolicy
    seconds: float
    num_output_tokens: int
    num_input_tokens: int
    num_steps: int
    num_preemptions: int
    # Positions the model computed: prompt positions (none came from the prefix cache, which
    # starts empty) and every sampled token but each request's last. Exact without preemption
    # (a recompute also recomputes sampled tokens) and without speculative decoding.
    num_tokens_forwarded: int = 0
    # A mixture-of-experts model's tokens per expert in this run (None for a dense model).
    expert_load: ExpertRoutingCounts | None = None

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.num_output_tokens + self.num_input_tokens) / self.seconds


def parse_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"expected a range like 32:512, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"range {text!r} must satisfy 1 <= low <= high")
    return low, high


def make_workload(
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> OfflineWorkload:
    """Random token prompts (like `vllm bench throughput --dataset random`)."""
    rng = random.Random(seed)
    # Low ids are often special tokens; stay clear of them.
    low_id = min(16, vocab_size - 1)
    prompts = [
        [rng.randrange(low_id, vocab_size) for _ in range(rng.randint(*input_range))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(*output_range) for _ in range(num_prompts)]
    return OfflineWorkload(prompts, output_lens)


def check_fits(workload: OfflineWorkload, max_model_len: int) -> None:
    """Refuses a workload whose requests the engine would cut short: a request whose prompt plus
    output exceeds max_model_len stops early ("length"), and its throughput would count
    tokens nobody asked for less than the workload says."""
    too_long = [
        (len(prompt), output_len)
        for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True)
        if len(prompt) + output_len > max_model_len
    ]
    if too_long:
        prompt_len, output_len = max(too_long, key=lambda pair: sum(pair))
        raise ValueError(
            f"{len(too_long)} of {len(workload.prompts)} requests need more than "
            f"max_model_len={max_model_len} positions (prompt + output; the longest "
            f"{prompt_len} + {output_len}) and would be cut short; shorten --input-len-range / "
            "--output-len-range, or raise --max-model-len where the model allows it"
        )


def run_policy(
    config: EngineConfig,
    runner: ModelRunner,
    workload: OfflineWorkload,
    policy: SchedulingPolicy,
    show_progress: bool,
) -> RunResult:
    from tqdm import tqdm

    if policy == "static":
        config = replace(config, enable_prefix_caching=False)
    engine = LLMEngine(
        config,
        runner=runner,
        scheduler_class=StaticBatchScheduler if policy == "static" else Scheduler,
    )
    for index, (prompt, output_len) in enumerate(
        zip(workload.prompts, workload.output_lens, strict=True)
    ):
        # Greedy and ignore_eos: every request produces exactly its target number of tokens.
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{policy}-{index}", prompt, params)
    finished: list[StepOutput] = []
    steps = 0
    total = sum(workload.output_lens)
    # The runner's counters are cumulative over the engines it served: this run's are the
    # difference (read outside the timed span: each read waits for the device).
    experts_before = engine.expert_routing_counts()
    start = time.perf_counter()
    # Output tokens (the bar's rate is output tok/s), and the requests done in the postfix.
    with tqdm(
        total=total, disable=not show_progress, unit="tok", desc=f"{policy:>10}", leave=True
    ) as progress:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            done = [o for o in outputs if o.finished]
            if done:
                finished.extend(done)
                progress.set_postfix_str(
                    f"{len(finished)}/{len(workload.prompts)} requests", refresh=False
                )
            progress.update(len(outputs))
    runner.synchronize()
    seconds = time.perf_counter() - start
    experts_after = engine.expert_routing_counts()
    load = engine.load()
    produced = sum(len(o.token_ids) for o in finished)
    if produced != total:
        # check_fits rules this out; a figure built on fewer tokens than asked must never pass.
        raise RuntimeError(
            f"{policy}: the requests produced {produced} output tokens, {total} were asked for"
        )
    return RunResult(
        policy=policy,
        seconds=seconds,
        num_output_tokens=sum(len(o.token_ids) for o in finished),
        num_input_tokens=workload.num_input_tokens,
        num_steps=steps,
        num_preemptions=load.num_preemptions,
        num_tokens_forwarded=load.num_prompt_tokens_computed
        + sum(len(o.token_ids) - 1 for o in finished),
        expert_load=(
            None
            if experts_before is None or experts_after is None
            else experts_after.since(experts_before)
        ),
    )


def expert_load_report(run: RunResult, exact: bool) -> dict[str, object]:
    """`moe_*` fields of a run on a mixture-of-experts model ({} for a dense one): per routed
    layer the tokens per expert and max/mean, and the sum, which must be the forwarded tokens
    x top_k x routed layers whenever `exact` (no preemption, no speculative decoding)."""
    load = run.expert_load
    if load is None:
        return {}
    expected = run.num_tokens_forwarded * load.top_k * len(load.layers) if exact else None
    if expected is not None and load.total != expected:
        raise RuntimeError(
            f"{run.policy}: the routers counted {load.total} routed tokens, expected "
            f"{run.num_tokens_forwarded} tokens x top_k {load.top_k} x {len(load.layers)} "
            f"routed layers = {expected}"
        )
    imbalances = {layer: expert_imbalance(counts) for layer, counts in load.layers}
    worst = max((value for value in imbalances.values() if value is not None), default=None)
    report: dict[str, object] = {
        "moe_top_k": load.top_k,
        "moe_routed_layers": len(load.layers),
        "moe_tokens_forwarded": run.num_tokens_forwarded,
        "moe_routed_tokens": load.total,
        # tokens x top_k x routed layers (None where preemption or drafts make it inexact).
        "moe_routed_tokens_expected": expected,
        "moe_imbalance_max": None if worst is None else round(worst, 3),
    }
    for layer, counts in load.layers:
        value = imbalances[layer]
        report[f"moe_layer_{layer}_imbalance"] = None if value is None else round(value, 3)
        report[f"moe_layer_{layer}_expert_tokens"] = list(counts)
    return report


def median_run(runs: list[RunResult]) -> RunResult:
    """The run of median duration (the lower middle one for an even count)."""
    middle = statistics.median_low(run.seconds for run in runs)
    return next(run for run in runs if run.seconds == middle)


def run_offline_benchmark(
    config: EngineConfig,
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    compare_static: bool,
    show_progress: bool,
    repeats: int = 1,
    workload: OfflineWorkload | None = None,
) -> dict[str, object]:
    """`workload`: these requests (`--batch-file`) instead of random ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if compare_static and config.speculative_config is not None:
        raise ValueError("static batching has no speculative decoding: drop one of the two")
    runner = ModelRunner(config, resolve_model(config.model))  # ignore_eos: no EOS masking
    if workload is None:
        workload = make_workload(
            num_prompts, input_range, output_range, runner.model_config.vocab_size, config.seed
        )
    num_prompts = len(workload.prompts)
    check_fits(workload, runner.max_model_len)
    # Warm-up (kernel compilation, allocator) outside the timed runs.
    warmup = make_workload(4, (8, 32), (4, 8), runner.model_config.vocab_size, config.seed + 1)
    run_policy(config, runner, warmup, "continuous", show_progress=False)

    policies: list[SchedulingPolicy] = (
        ["continuous", "static"] if compare_static else ["continuous"]
    )
    runs: dict[str, list[RunResult]] = {policy: [] for policy in policies}
    for _ in range(repeats):
        for policy in policies:
            runs[policy].append(run_policy(config, runner, workload, policy, show_progress))
    continuous = median_run(runs["continuous"])
    report: dict[str, object] = {
        "model": config.model,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "quantization": config.quantization or "none",
        "num_prompts": num_prompts,
        "input_len_range": list(input_range),
        "output_len_range": list(output_range),
        "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""),
        "num_kv_blocks": runner.kv_cache.num_blocks,
        # Capacity: the tokens the pool holds, and what it costs (8-bit scales included).
        "kv_cache_tokens": runner.kv_cache.num_blocks * config.block_size,
        "kv_cache_mib": round(runner.kv_cache_bytes / 2**20, 2),
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "input_tokens": workload.num_input_tokens,
        "output_tokens": continuous.num_output_tokens,
        "repeats": repeats,
        "continuous_seconds": round(continuous.seconds, 3),
        "continuous_output_tok_s": round(continuous.output_tok_s, 1),
        "continuous_total_tok_s": round(continuous.total_tok_s, 1),
        "continuous_steps": continuous.num_steps,
        "continuous_preemptions": continuous.num_preemptions,
        "continuous_seconds_all": [round(run.seconds, 3) for run in runs["continuous"]],
        **expert_load_report(
            continuous,
            exact=continuous.num_preemptions == 0 and config.speculative_config is None,
        ),
    }
    if compare_static:
        static = median_run(runs["static"])
        report.update(
            {
                "static_seconds": round(static.seconds, 3),
                "static_output_tok_s": round(static.output_tok_s, 1),
                "static_total_tok_s": round(static.total_tok_s, 1),
                "static_steps": static.num_steps,
                "static_seconds_all": [round(run.seconds, 3) for run in runs["static"]],
                "ratio": round(continuous.output_tok_s / static.output_tok_s, 3),
            }
        )
    return report
