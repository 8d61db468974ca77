"""`nori bench spec-decode`: decode speed with and without speculative decoding, batch by batch.

The same prompts (the `copy` dataset: documents to summarise, quote or rewrite, where drafts from
the prompt pay; or plain ShareGPT conversations) run through one engine per batch size with
speculation and one without, sharing the loaded weights. Runs alternate (plain, speculative;
then the other order) for `rounds` rounds, and each figure is the median over the rounds; the
ratio is the median of the rounds' ratios, each taken back to back.

Decode tokens/s counts only steps that computed no prompt token: a step's tokens over its time.
Prompts are a fixed cost that speculation does not touch (the end-to-end figure beside it
includes them). The acceptance rate and mean accepted length come from the engine's counters.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from nori.bench.serve.copy_dataset import copy_requests
from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.sharegpt import read_exchanges
from nori.engine.config import EngineConfig, SpeculativeConfig
from nori.engine.engine import LLMEngine
from nori.engine.model_runner import ModelRunner
from nori.models.demo import resolve_model
from nori.sampling.chat_template import ChatTemplateError
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer

Dataset = Literal["copy", "sharegpt"]
DEFAULT_SPECULATIVE = SpeculativeConfig(
    "ngram", 6, prompt_lookup_min=2, prompt_lookup_max=4, disable_by_batch_size=32
)


@dataclass(frozen=True)
class SpecBenchSettings:
    dataset: Dataset
    dataset_path: Path
    batch_sizes: tuple[int, ...]
    # Requests per batch size: this many batches' worth (at least 4 requests).
    batches_per_size: int = 2
    max_tokens: int = 128
    max_prompt_len: int = 768
    rounds: int = 3
    seed: int = 0


@dataclass(frozen=True)
class RunFigures:
    decode_tokens_per_s: float
    end_to_end_tokens_per_s: float
    output_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    outputs: tuple[tuple[int, ...], ...]


def chat_prompts(tokenizer: Tokenizer, settings: SpecBenchSettings, count: int) -> list[list[int]]:
    """`count` prompts as token ids, through the model's chat template (an instruct model
    answers a document's instruction as its users would ask it)."""
    rng = np.random.default_rng(settings.seed)
    if settings.dataset == "copy":
        maker = PromptMaker.create(tokenizer, "text")
        texts = [
            str(spec.prompt)
            for spec in copy_requests(
                settings.dataset_path,
                maker,
                rng,
                count,
                settings.max_prompt_len,
                settings.max_tokens,
            )
        ]
    else:
        exchanges = read_exchanges(settings.dataset_path)
        texts = [exchanges[int(i)][0] for i in rng.permutation(len(exchanges))]
    prompts = []
    for text in texts:
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            # Templates write their own BOS (as LLM.chat encodes them).
            ids = tokenizer.encode(rendered, add_special_tokens=False)
        except ChatTemplateError:  # a base model: the text as a completion prompt
            ids = tokenizer.encode(text)
        if len(ids) <= settings.max_prompt_len:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def run_once(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> RunFigures:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    counts_before = engine.load().spec_decode
    decode_s = 0.0
    decode_tokens = 0
    tokens: dict[str, tuple[int, ...]] = {}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        prompt_before = engine.load().num_prompt_tokens_computed
        step_started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - step_started
        if engine.load().num_prompt_tokens_computed == prompt_before:
            decode_s += elapsed
            decode_tokens += sum(len(output.new_token_ids) for output in outputs)
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = tuple(output.token_ids)
    total_s = time.perf_counter() - started
    counts = engine.load().spec_decode
    drafts = counts.num_drafts - counts_before.num_drafts
    draft_tokens = counts.num_draft_tokens - counts_before.num_draft_tokens
    accepted = counts.num_accepted_tokens - counts_before.num_accepted_tokens
    output_tokens = sum(len(t) for t in tokens.values())
    return RunFigures(
        decode_tokens_per_s=decode_tokens / decode_s if decode_s else 0.0,
        end_to_end_tokens_per_s=output_tokens / total_s,
        output_tokens=output_tokens,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_accepted_length=1 + accepted / drafts if drafts else None,
        outputs=tuple(tokens[f"{tag}-{i}"] for i in range(len(prompts))),
    )


def run_spec_decode_benchmark(
    config: EngineConfig, settings: SpecBenchSettings, show: bool = True
) -> dict[str, Any]:
    speculative = config.speculative_config or DEFAULT_SPECULATIVE
    spec_config = replace(config, speculative_config=speculative)
    plain_config = replace(config, speculative_config=None)
    model_dir = resolve_model(config.model)
    # One set of weights (and a draft model, if any) for every engine.
    runner = ModelRunner(
        replace(spec_config, max_num_seqs=max(settings.batch_sizes)),
        model_dir,
        Tokenizer.from_dir(model_dir).eos_token_ids,
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    rows = []
    for batch_size in settings.batch_sizes:
        count = max(batch_size * settings.batches_per_size, 4)
        prompts = chat_prompts(tokenizer, settings, count)
        engines = {
            "plain": LLMEngine(replace(plain_config, max_num_seqs=batch_size), runner),
            "spec": LLMEngine(replace(spec_config, max_num_seqs=batch_size), runner),
        }
        # A warm-up of each, untimed (kernels, allocator, caches).
        for name, engine in engines.items():
            run_once(engine, prompts[:batch_size], 8, f"warm-{name}")
        runs: dict[str, list[RunFigures]] = {"plain": [], "spec": []}
        for round_index in range(settings.rounds):
            order = ("plain", "spec") if round_index % 2 == 0 else ("spec", "plain")
            for name in order:
                # A fresh prefix cache each run: both see the same prompt work.
                engines[name] = LLMEngine(replace(engines[name].config), runner)
                figures = run_once(engines[name], prompts, settings.max_tokens, f"r{round_index}")
                runs[name].append(figures)
                if show:
                    print(
                        f"batch {batch_size:3d} round {round_index + 1} {name:5s}: "
                        f"decode {figures.decode_tokens_per_s:8.1f} tok/s, "
                        f"end to end {figures.end_to_end_tokens_per_s:8.1f} tok/s",
                        flush=True,
                    )
        # Outputs token-identical to the plain run's (float32: all; in bf16 a verification's
        # multi-row GEMMs round differently from a one-row decode's, and a near tie can flip).
        plain_outputs, spec_outputs = runs["plain"][-1].outputs, runs["spec"][-1].outputs
        identical = sum(a == b for a, b in zip(plain_outputs, spec_outputs, strict=True))
        ratios = [
            spec.decode_tokens_per_s / plain.decode_tokens_per_s
            for plain, spec in zip(runs["plain"], runs["spec"], strict=True)
        ]
        e2e_ratios = [
            spec.end_to_end_tokens_per_s / plain.end_to_end_tokens_per_s
            for plain, spec in zip(runs["plain"], runs["spec"], strict=True)
        ]
        last = runs["spec"][-1]
        rows.append(
            {
                "batch_size": batch_size,
                "num_prompts": len(prompts),
                "plain_decode_tokens_per_s": statistics.median(
                    r.decode_tokens_per_s for r in runs["plain"]
                ),
                "spec_decode_tokens_per_s": statistics.median(
                    r.decode_tokens_per_s for r in runs["spec"]
                ),
                "decode_speedup": statistics.median(ratios),
                "decode_speedups": ratios,
                "end_to_end_speedup": statistics.median(e2e_ratios),
                "acceptance_rate": last.acceptance_rate,
                "mean_accepted_length": last.mean_accepted_length,
                "outputs_identical": identical,
                "outputs_compared": len(plain_outputs),
            }
        )
    return {
        "model": config.model,
        "dtype": config.dtype,
        "dataset": settings.dataset,
        "speculative_config": json.loads(speculative.as_json()),
        "max_tokens": settings.max_tokens,
        "rounds": settings.rounds,
        "host": host_description(),
        "rows": rows,
    }


def host_description() -> str:
    """The CPU model and count, as every figure must state it."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']} ({report['dtype']}), dataset {report['dataset']}, "
        f"max_tokens {report['max_tokens']}, median of {report['rounds']} alternating rounds",
        f"speculative config {json.dumps(report['speculative_config'])}",
        f"host {report['host']}",
        "",
        f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'decode x':>9} {'e2e x':>6} "
        f"{'accept':>7} {'mean len':>9} {'identical':>10}",
    ]
    for row in report["rows"]:
        rate = row["acceptance_rate"]
        length = row["mean_accepted_length"]
        lines.append(
            f"{row['batch_size']:>5} {row['plain_decode_tokens_per_s']:>12.1f} "
            f"{row['spec_decode_tokens_per_s']:>11.1f} {row['decode_speedup']:>8.2f}x "
            f"{row['end_to_end_speedup']:>5.2f}x "
            f"{'-' if rate is None else f'{rate:.2f}':>7} "
            f"{'-' if length is None else f'{length:.2f}':>9} "
            f"{row['outputs_identical']:>6}/{row['outputs_compared']:<3}"
        )
    return "\n".join(lines)
