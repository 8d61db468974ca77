"""`nori bench fidelity`: how far quantization (or bfloat16) moves a model from its float32 self.

Three figures:

- step agreement: with the float32 completion forced on both (teacher forcing), the share of
  output positions where the quantized model's greedy choice is float32's. This is the
  per-token reading of "greedy output matches float32": each step judged on the same history;
- sequence agreement: the quantized and the float32 engine each complete the prompts freely;
  the share of output positions holding the same token. One flipped near-tie sends the rest of
  a completion elsewhere, so on a 260K-parameter model this falls far below the step figure
  even for bfloat16;
- logits cosine: the cosine similarity of the two models' logits at every forced position; the
  minimum and the mean.

The prompts are the float32 model's own sampled text (seeded), so they look like its training
data rather than random ids, on which a small model's logits are flat and any rounding flips them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nori.engine.llm import LLM
from nori.models.dtypes import DTYPES
from nori.models.llama import CausalLM
from nori.models.loader import load_model
from nori.sampling.params import SamplingParams


@dataclass(frozen=True)
class FidelitySettings:
    model: str
    quantization: str | None = None
    # The compared side's dtype (bfloat16: the CPU's fast half type), against float32.
    dtype: str = "float32"
    num_prompts: int = 16
    prompt_len: int = 64
    output_len: int = 64
    seed: int = 0
    starts: tuple[str, ...] = field(
        default=("Once upon a time", "The little dog", "Lily wanted to", "One day, a big")
    )


@dataclass(frozen=True)
class FidelityReport:
    step_agreement: float
    sequence_agreement: float
    min_cosine: float
    mean_cosine: float
    num_positions: int

    def as_dict(self) -> dict[str, object]:
        return {
            "step_agreement": self.step_agreement,
            "sequence_agreement": self.sequence_agreement,
            "min_logits_cosine": self.min_cosine,
            "mean_logits_cosine": self.mean_cosine,
            "num_positions": self.num_positions,
        }


def measure_fidelity(settings: FidelitySettings) -> FidelityReport:
    reference = LLM(settings.model, dtype="float32", num_kv_blocks=512, seed=settings.seed)
    prompts = sampled_prompts(reference, settings)
    greedy = SamplingParams(max_tokens=settings.output_len, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    quantized = LLM(
        settings.model,
        dtype=settings.dtype,
        num_kv_blocks=512,
        quantization=settings.quantization,
    )
    got = [o.outputs[0].token_ids for o in quantized.generate(prompts, greedy, use_tqdm=False)]
    same = sum(
        a == b
        for want, have in zip(expected, got, strict=True)
        for a, b in zip(want, have, strict=True)
    )
    total = sum(len(want) for want in expected)

    cosines, agreeing = teacher_forced(settings, prompts, expected)
    return FidelityReport(
        step_agreement=float(agreeing.float().mean()),
        sequence_agreement=same / total,
        min_cosine=float(cosines.min()),
        mean_cosine=float(cosines.mean()),
        num_positions=int(cosines.numel()),
    )


def sampled_prompts(llm: LLM, settings: FidelitySettings) -> list[list[int]]:
    """`num_prompts` prompts of exactly `prompt_len` tokens of the model's own sampled text."""
    prompts: list[list[int]] = []
    for index in range(settings.num_prompts):
        start = llm.tokenizer.encode(settings.starts[index % len(settings.starts)])
        params = SamplingParams(
            max_tokens=settings.prompt_len - len(start),
            temperature=1.0,
            seed=settings.seed + index,
            ignore_eos=True,
        )
        (output,) = llm.generate([start], params, use_tqdm=False)
        prompts.append((start + output.outputs[0].token_ids)[: settings.prompt_len])
    return prompts


def teacher_forced(
    settings: FidelitySettings, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the float32 sequences, at each position that chose an output token: the cosine
    similarity of float32 and quantized logits, and whether the quantized argmax is float32's
    token (1-D each, all prompts' positions together)."""
    reference, _ = load_model(settings.model, torch.float32, "cpu")
    quantized, _ = load_model(
        settings.model, DTYPES[settings.dtype], "cpu", quantization=settings.quantization
    )
    cosines, agreeing = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor(prompt + completion[:-1])
        first = len(prompt) - 1  # the position whose logits chose output token one
        want = _logits(reference, ids)[first:]
        have = _logits(quantized, ids)[first:]
        cosines.append(F.cosine_similarity(want, have, dim=-1))
        agreeing.append(have.argmax(dim=-1) == torch.tensor(completion))
    return torch.cat(cosines), torch.cat(agreeing)


@torch.inference_mode()
def _logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), _dense_causal_attention)
    return model.compute_logits(hidden)


def _dense_causal_attention(
    layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence, all positions at once (no cache: the engine's paged path is what the
    greedy agreement above runs)."""
    group = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1)
    k = key.transpose(0, 1).repeat_interleave(group, dim=0)
    v = value.transpose(0, 1).repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(0, 1).contiguous()
