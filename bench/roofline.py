"""`nori bench roofline`: this host's limits, and how far the engine's steps are from them.

Measured here, each the best of a few tries (the floor is what the hardware allows at best):

- memory read bandwidth: summing a float32 tensor far larger than the caches;
- GEMM peak per type: a 2048^3 matrix product in float32 and bfloat16, and int8 (torch._int_mm)
  where this build has it; smaller for a type whose product already takes 0.1 s (a type with no
  fast path on this CPU).

Then, for the model and the engine options given:

- **decode floor** at batch B and context C: (weight bytes + B x C x KV bytes per token) / read
  bandwidth. A decode step must read every weight once and each row's KV; the weights are counted
  from the model's shape (the decoder layers' projections at the stored width, 1 byte for int8 or
  fp8, plus the LM head), not from whatever copies a backend keeps;
- **prefill floor** for one prompt of P tokens: FLOPs / the GEMM peak of the compute type, where
  FLOPs = 2 x layer-projection parameters x P + the causal attention's 2 x layers x heads x
  head_dim x P^2 + one row of the LM head (the engine computes logits for the last token only);
- the engine's measured step times (median of the timed steps) and measured / floor;
- beside each decode floor, the step's **compute floor**: its FLOPs (each row's projections and
  LM head, and its attention over C tokens) / the GEMM peak of the compute type (all of them at
  that peak, an int8 model's bf16 LM head too: a lower bound). Where that is the larger (bf16 at
  batch 64 on a CPU without AMX), no kernel reaches the memory floor, and `roofline_ratio`
  (measured / the larger of the two) says how far the step is from what the host allows.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.kv_cache import bytes_per_block
from nori.engine.model_runner import ModelRunner
from nori.models.config import ModelConfig
from nori.models.demo import resolve_model
from nori.sampling.params import SamplingParams

BANDWIDTH_BYTES = 1 << 30  # 1 GiB: past any L3 this kind of host reports per VM
GEMM_SIZE = 2048
# One product this long is enough to measure a type's peak: no larger size is tried.
GEMM_BUDGET_S = 0.1
TRIES = 5


@dataclass(frozen=True)
class HostLimits:
    read_gb_s: float
    gemm_tflops: dict[str, float]


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    context: int
    measured_ms: float
    # Bytes read / bandwidth (the floor) and FLOPs / GEMM peak.
    floor_ms: float
    compute_floor_ms: float

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.floor_ms

    @property
    def roofline_ratio(self) -> float:
        return self.measured_ms / max(self.floor_ms, self.compute_floor_ms)


@dataclass(frozen=True)
class PrefillRow:
    prompt_len: int
    measured_ms: float
    floor_ms: float
    achieved_tflops: float

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.floor_ms


def _best_seconds(run: Any, tries: int = TRIES) -> float:
    run()  # warm: page faults, oneDNN's primitive cache
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure_read_bandwidth(num_bytes: int = BANDWIDTH_BYTES) -> float:
    """GB/s read by a reduction over a tensor of `num_bytes`."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: data.sum())
    return num_bytes / seconds / 1e9


def measure_gemm_tflops(size: int = GEMM_SIZE) -> dict[str, float]:
    """TFLOP/s (TOP/s for int8) of a square matrix product per type this build runs, at `size`
    or at the size (from 256, doubling) where one product first takes GEMM_BUDGET_S: a type
    without a fast path here (bfloat16 on an AVX2-only host: 55 s for one 2048^3 product) is
    measured in seconds, not minutes."""
    peaks: dict[str, float] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        peaks[name] = _product_tflops(partial(_float_pair, dtype=dtype), torch.mm, size)
    try:
        torch._int_mm(*_int8_pair(32))
    except (RuntimeError, NotImplementedError):
        return peaks  # no int8 matrix product on this CPU build
    peaks["int8"] = _product_tflops(_int8_pair, torch._int_mm, size)
    return peaks


def _float_pair(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)


def _int8_pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randint(-64, 64, (n, n), dtype=torch.int8),
        torch.randint(-64, 64, (n, n), dtype=torch.int8),
    )


def _product_tflops(
    make: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    size: int,
) -> float:
    n = min(256, size)
    while True:
        a, b = make(n)
        seconds = _best_seconds(lambda a=a, b=b: product(a, b))
        if n >= size or seconds >= GEMM_BUDGET_S:
            return 2 * n**3 / seconds / 1e12
        n = min(2 * n, size)


def measure_host() -> HostLimits:
    return HostLimits(measure_read_bandwidth(), measure_gemm_tflops())


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(
    model: ModelConfig, dtype: torch.dtype, quantization: str | None, quantize_lm_head: bool = False
) -> int:
    """Bytes of weights one decode step reads: every decoder projection and the LM head (the
    embedding table is only gathered, B rows, unless tied to the head)."""
    projection = 1 if quantization in ("int8", "fp8") else _element_bytes(dtype)
    head = projection if quantize_lm_head else _element_bytes(dtype)
    # A mixture-of-experts step at decode batch sizes touches nearly every expert: all of them
    # are counted (a lower bound on the floor at batch 1, where only top-k experts are read).
    return (
        _projection_params(model, every_expert=True) * projection
        + model.vocab_size * model.hidden_size * head
    )


def _projection_params(model: ModelConfig, every_expert: bool) -> int:
    """All decoder layers' projection parameters; of a mixture-of-experts layer's experts, all
    of them (`every_expert`: the bytes a step may read) or the top-k a token runs (its FLOPs)."""
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    hidden = model.hidden_size
    attention = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
    total = 0
    for index in range(model.num_hidden_layers):
        if not model.is_moe_layer(index):
            total += attention + 3 * hidden * model.intermediate_size
            continue
        experts = model.num_experts if every_expert else model.num_experts_per_tok
        shared = model.shared_expert_intermediate_size
        total += (
            attention
            + hidden * model.num_experts  # the router
            + experts * 3 * hidden * model.moe_intermediate_size
            + (3 * hidden * shared + hidden if shared else 0)
        )
    return total


def prefill_flops(model: ModelConfig, prompt_len: int) -> float:
    layers = model.num_hidden_layers
    projections = 2 * _projection_params(model, every_expert=False) * prompt_len
    attention = 2 * layers * model.num_attention_heads * model.head_dim * prompt_len**2
    head = 2 * model.hidden_size * model.vocab_size
    return float(projections + attention + head)


def decode_flops(model: ModelConfig, batch: int, context: int) -> float:
    """A decode step of `batch` rows, each attending to `context` tokens: every row's
    projections and LM head, and its QK and PV products."""
    layers = model.num_hidden_layers
    projections = 2 * _projection_params(model, every_expert=False)
    attention = 4 * layers * model.num_attention_heads * model.head_dim * context
    head = 2 * model.hidden_size * model.vocab_size
    return float(batch * (projections + attention + head))


def compute_type(dtype: torch.dtype, quantization: str | None) -> str:
    if quantization == "int8":
        return "int8"
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(16, vocab_size) for _ in range(length)]


def time_decode(
    config: EngineConfig, runner: ModelRunner, batch: int, context: int, steps: int
) -> float:
    """Median seconds of a decode step with `batch` rows of about `context` tokens each."""
    engine = LLMEngine(replace(config, max_num_seqs=max(batch, 1)), runner=runner)
    rng = random.Random(batch)
    vocab = runner.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"d{index}", _random_prompt(rng, context, vocab), params)
    # Prefill every row (each then has its first token) and warm the batch's shapes with one
    # decode step before timing.
    started_rows: set[str] = set()
    while len(started_rows) < batch:
        started_rows.update(output.request_id for output in engine.step())
    engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.abort_all()
    return statistics.median(times)


def time_prefill(config: EngineConfig, runner: ModelRunner, prompt_len: int, tries: int) -> float:
    """Best seconds of one step that computes a whole prompt of `prompt_len` tokens."""
    engine = LLMEngine(
        replace(config, max_num_batched_tokens=max(prompt_len, config.max_num_batched_tokens)),
        runner=runner,
    )
    rng = random.Random(prompt_len)
    vocab = runner.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for index in range(tries + 1):  # the first warms the shapes
        # A new random prompt each time: nothing comes from the prefix cache.
        engine.add_request(f"p{index}", _random_prompt(rng, prompt_len, vocab), params)
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        while engine.has_unfinished_requests():
            engine.step()
        if index:
            best = min(best, seconds)
    return best


def run_roofline(
    config: EngineConfig,
    batch_sizes: list[int],
    context: int,
    prompt_len: int,
    steps: int,
    host: HostLimits | None = None,
) -> dict[str, Any]:
    host = host or measure_host()
    model_dir = resolve_model(config.model)
    config = replace(config, model=str(model_dir))
    runner = ModelRunner(config, model_dir, frozenset())
    model = runner.model_config
    dtype = runner.dtype
    weights = weight_bytes(model, dtype, config.quantization, config.quantize_lm_head)
    kv_per_token = bytes_per_block(model, config.block_size, runner.kv_cache_dtype) // (
        config.block_size
    )
    bandwidth = host.read_gb_s * 1e9
    kind = compute_type(dtype, config.quantization)
    peak = host.gemm_tflops.get(kind, host.gemm_tflops["float32"]) * 1e12
    decode = []
    for batch in batch_sizes:
        measured = time_decode(config, runner, batch, context, steps)
        floor = (weights + batch * context * kv_per_token) / bandwidth
        compute_floor = decode_flops(model, batch, context) / peak
        decode.append(DecodeRow(batch, context, measured * 1e3, floor * 1e3, compute_floor * 1e3))
    flops = prefill_flops(model, prompt_len)
    measured_prefill = time_prefill(config, runner, prompt_len, tries=3)
    prefill = PrefillRow(
        prompt_len, measured_prefill * 1e3, flops / peak * 1e3, flops / measured_prefill / 1e12
    )
    return {
        "host": asdict(host),
        "model": config.model,
        "dtype": str(dtype).replace("torch.", ""),
        "quantization": config.quantization,
        "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""),
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "compute_type": kind,
        "decode": [
            {
                **asdict(row),
                "ratio": round(row.ratio, 3),
                "roofline_ratio": round(row.roofline_ratio, 3),
            }
            for row in decode
        ],
        "prefill": {**asdict(prefill), "ratio": round(prefill.ratio, 3)},
    }


def format_report(report: dict[str, Any]) -> str:
    host = report["host"]
    peaks = ", ".join(f"{name} {value:.2f}" for name, value in host["gemm_tflops"].items())
    lines = [
        f"host: read {host['read_gb_s']:.1f} GB/s; GEMM peak (TFLOP/s, int8 TOP/s): {peaks}",
        f"model {report['model']}: {report['dtype']}, quantization {report['quantization']}, "
        f"KV {report['kv_cache_dtype']}; weights read per decode step "
        f"{report['weight_bytes'] / 1e6:.1f} MB, KV {report['kv_bytes_per_token']} B/token",
        f"{'decode batch':>12} {'context':>8} {'measured ms':>12} {'floor ms':>9} {'ratio':>6} "
        f"{'compute floor ms':>17} {'roofline ratio':>15}",
    ]
    for row in report["decode"]:
        lines.append(
            f"{row['batch']:>12} {row['context']:>8} {row['measured_ms']:>12.2f} "
            f"{row['floor_ms']:>9.2f} {row['ratio']:>6.2f} {row['compute_floor_ms']:>17.2f} "
            f"{row['roofline_ratio']:>15.2f}"
        )
    prefill = report["prefill"]
    lines.append(
        f"prefill {prefill['prompt_len']} tokens ({report['compute_type']}): "
        f"{prefill['measured_ms']:.1f} ms against a floor of {prefill['floor_ms']:.1f} ms "
        f"(ratio {prefill['ratio']:.2f}; {prefill['achieved_tflops']:.2f} TFLOP/s achieved)"
    )
    return "\n".join(lines)
