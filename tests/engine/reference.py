"""Hugging Face transformers as the independent reference for engine outputs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nori.engine.engine import LLMEngine
from nori.engine.scheduler import SchedulerOutput


@dataclass
class HFGreedy:
    tokens: list[int]
    # [num_new_tokens, vocab]: the raw logits each generated token was picked from.
    logits: torch.Tensor


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[HFGreedy]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # EOS must not end generation early: the engine side runs with ignore_eos.
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logits = torch.cat([step[0:1] for step in out.logits], dim=0)
            results.append(HFGreedy(tokens, logits))
    return results


@dataclass
class EngineTrace:
    """Per request, the logits of each sampled token, plus what the scheduler did."""

    logits: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    num_preemptions: int = 0
    max_tokens_in_step: int = 0
    num_chunked_steps: int = 0

    def stacked(self, request_id: str) -> torch.Tensor:
        return torch.stack(self.logits[request_id])


@contextmanager
def trace_engine(engine: LLMEngine) -> Iterator[EngineTrace]:
    """Records the logits rows the engine samples from, without changing the engine."""
    trace = EngineTrace()
    scheduler, model = engine._scheduler, engine._runner.model
    original_schedule, original_logits = scheduler.schedule, model.compute_logits
    last: list[SchedulerOutput] = []

    def schedule(spec_lengths: Mapping[str, int] | None = None) -> SchedulerOutput:
        output = original_schedule(spec_lengths)
        last[:] = [output]
        trace.num_preemptions += len(output.preempted)
        trace.max_tokens_in_step = max(trace.max_tokens_in_step, output.num_batched_tokens)
        partial = [s for s in output.scheduled if s.num_new_tokens > 1 and not s.samples]
        trace.num_chunked_steps += bool(partial)
        return output

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = original_logits(hidden)
        samplers = [s.request.request_id for s in last[0].scheduled if s.samples]
        for request_id, row in zip(samplers, logits, strict=True):
            trace.logits[request_id].append(row.detach().float().cpu())
        return logits

    scheduler.schedule = schedule  # type: ignore[method-assign]
    model.compute_logits = compute_logits  # type: ignore[method-assign]
    try:
        yield trace
    finally:
        scheduler.schedule = original_schedule  # type: ignore[method-assign]
        model.compute_logits = original_logits  # type: ignore[method-assign]
