"""`nori bench fidelity`: how far quantization (8-bit weights, an 8-bit KV cache, or bfloat16)
moves a model from its float32 self.

Three figures:

- step agreement: with the float32 completion forced on both (teacher forcing), the share of
  output positions where the quantized model's greedy choice is float32's. This is the
  per-token reading of "greedy output matches float32": each step judged on the same history;
- sequence agreement: the quantized and the float32 engine each complete the prompts freely;
  the share of output positions holding the same token. One flipped near-tie sends the rest of
  a completion elsewhere, so on a 260K-parameter model this falls far below the step figure
  even for bfloat16;
- logits cosine: the cosine similarity of the two models' logits at every forced position; the
  minimum, the mean, and the share of positions under 0.99.

The prompts are the float32 model's own sampled text (seeded), so they look like its training
data rather than random ids, on which a small model's logits are flat and any rounding flips them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nori.engine.llm import LLM
from nori.kernels.kv_quant import KV_CACHE_DTYPES, dequantize_kv_reference, quantize_kv_reference
from nori.models.dtypes import DTYPES
from nori.models.llama import CausalLM
from nori.models.loader import load_model
from nori.sampling.params import SamplingParams

# The per-step cosine bound; the report counts the steps under it.
LOW_COSINE = 0.99


@dataclass(frozen=True)
class FidelitySettings:
    model: str
    quantization: str | None = None
    # The compared side's dtype (bfloat16: the CPU's fast half type), against float32.
    dtype: str = "float32"
    # "auto" (the KV cache in `dtype`), "int8" or "fp8".
    kv_cache_dtype: str = "auto"
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
    # The share of positions whose cosine is under 0.99: whether a low minimum is one step.
    low_cosine_share: float
    num_positions: int

    def as_dict(self) -> dict[str, object]:
        return {
            "step_agreement": self.step_agreement,
            "sequence_agreement": self.sequence_agreement,
            "min_logits_cosine": self.min_cosine,
            "mean_logits_cosine": self.mean_cosine,
            "share_of_steps_under_0_99": self.low_cosine_share,
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
        kv_cache_dtype=settings.kv_cache_dtype,
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
        low_cosine_share=float((cosines < LOW_COSINE).float().mean()),
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
    quantized_attention: Attention = dense_causal_attention
    if settings.kv_cache_dtype != "auto":
        quantized_attention = stored_kv_attention(KV_CACHE_DTYPES[settings.kv_cache_dtype])
    cosines, agreeing = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor(prompt + completion[:-1])
        first = len(prompt) - 1  # the position whose logits chose output token one
        want = model_logits(reference, ids, dense_causal_attention)[first:]
        have = model_logits(quantized, ids, quantized_attention)[first:]
        cosines.append(F.cosine_similarity(want, have, dim=-1))
        agreeing.append(have.argmax(dim=-1) == torch.tensor(completion))
    return torch.cat(cosines), torch.cat(agreeing)


Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@torch.inference_mode()
def model_logits(model: CausalLM, ids: torch.Tensor, attention: Attention) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), attention)
    return model.compute_logits(hidden)


def stored_kv_attention(cache_dtype: torch.dtype) -> Attention:
    """Dense attention over K/V as an 8-bit cache would hold them (quantized, dequantized):
    the engine's attention reads every row back from the cache, its own prompt's included."""

    def attention(
        layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        stored_key = dequantize_kv_reference(*quantize_kv_reference(key, cache_dtype), key.dtype)
        stored_value = dequantize_kv_reference(
            *quantize_kv_reference(value, cache_dtype), value.dtype
        )
        return dense_causal_attention(layer_index, query, stored_key, stored_value, scale)

    return attention


def dense_causal_attention(
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
