"""Engine settings, frozen once built; derived values are properties or resolved at start.

Every mode is a `Literal` type (mypy checks the callers; `typing.get_args` gives the CLI its
`choices`), and `EngineConfig.__post_init__` checks the values given at run time against them."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from nori.settings import DEFAULT_BLOCK_SIZE

# "auto": float32 on CPU, the checkpoint's half type (else bfloat16) on GPU.
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["int8", "fp8"]
# The 8-bit names are nori.kernels.kv_quant.KV_CACHE_DTYPES' keys (not imported: no torch here).
KVCacheDtype = Literal["auto", "int8", "fp8"]
# "dummy": random weights on the device instead of reading safetensors (benchmarks).
LoadFormat = Literal["auto", "dummy"]
AttentionBackend = Literal["auto", "triton", "cpu", "reference"]
SpeculativeMethod = Literal["ngram", "draft_model"]
# A number of prompt tokens, "auto" (learnt from the steps' timings) or None (no cap).
PrefillBudget = int | Literal["auto"] | None


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: a proposer drafts tokens, the model verifies them in one step.

    Greedy requests get exactly the tokens of a run without speculation; sampled ones keep the
    model's distribution (accept with min(1, p/q), else sample from max(0, p - q) normalised)."""

    method: SpeculativeMethod
    num_speculative_tokens: int  # per request and step
    # draft_model: a checkpoint folder (or "demo"-style name) sharing the target's tokenizer.
    model: str | None = None
    # ngram: the longest and shortest suffix n-gram looked up in the request's own tokens.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No speculation in a step whose running batch holds at least this many requests; None: always.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_mode("method", self.method, SpeculativeMethod)
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a string (a checkpoint), got {self.model!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('method "draft_model" needs "model": the draft checkpoint')
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError('method "ngram" takes no "model"')
            low, high = self.lookup_range
            if low < 1 or high < low:
                raise ValueError(
                    "prompt_lookup_min and prompt_lookup_max must satisfy "
                    f"1 <= min <= max, got {low} and {high}"
                )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @property
    def lookup_range(self) -> tuple[int, int]:
        """ngram's (min, max) suffix length: both 5 when neither is set, else the one set for both."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        if low is None:
            low = high
        if high is None:
            high = low
        assert low is not None and high is not None
        return low, high

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's --speculative-config JSON (or its dict). ValueError names what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative config key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f'speculative config needs "{key}"')
        return cls(**value)

    def as_json(self) -> str:
        """Canonical JSON: what a worker states in the registry; two workers must share it."""
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        return json.dumps({k: v for k, v in values.items() if v is not None}, sort_keys=True)


@dataclass(frozen=True)
class EngineConfig:
    """What `LLM` and the workers are built from; the CLI's flags map onto these fields.

    `device`: "auto", "cpu", "cuda" or "cuda:N". `num_kv_blocks` wins over the memory budgets
    (`cpu_kv_cache_gib`, `gpu_memory_utilization`). Prefill budgets: see SchedulerConfig ("auto":
    learnt in step_cost.py). `attention_backend` "auto": Triton on GPU, on CPU the C++ kernel
    where it builds, else the PyTorch references. The flags: docs/serving.md."""

    model: str = "demo"  # "demo" (random weights, made on first use) or a checkpoint folder
    tokenizer: str | None = None  # None: the model's
    dtype: Dtype = "auto"
    device: str = "auto"
    quantization: Quantization | None = None  # weight-only, the decoder's linear layers
    quantize_lm_head: bool = False
    # "int8"/"fp8": 8-bit codes with a float16 scale per token and kv head (nori.kernels.kv_quant).
    kv_cache_dtype: KVCacheDtype = "auto"
    tensor_parallel_size: int = 1
    # Experts go whole to the ranks instead of sliced; a no-op at one rank or for a dense model.
    enable_expert_parallel: bool = False
    load_format: LoadFormat = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    cpu_kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.9  # weights and KV cache together
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefill_budget_with_decodes: PrefillBudget = None
    background_prefill_budget: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0  # dummy weights and the sampler of unseeded requests
    attention_backend: AttentionBackend = "auto"
    speculative_config: SpeculativeConfig | None = None
    # On CUDA, pure decode steps replay CUDA graphs captured at bucketed batch sizes; True keeps
    # every step eager (vLLM's --enforce-eager). No effect on CPU.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        for name, modes in _MODES.items():
            check_mode(name, getattr(self, name), modes)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        budget = self.prefill_budget_with_decodes
        if budget is not None and budget != "auto" and (not isinstance(budget, int) or budget < 1):
            raise ValueError(
                f"prefill_budget_with_decodes must be an int >= 1, 'auto' or None, got {budget!r}"
            )
        background = self.background_prefill_budget
        if background is not None and background < 1:
            raise ValueError(f"background_prefill_budget must be >= 1 or None, got {background}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization method (int8 or fp8)")
        speculative = self.speculative_config
        if (
            speculative is not None
            and speculative.method == "draft_model"
            and self.tensor_parallel_size > 1
        ):
            raise ValueError("a draft model with tensor_parallel_size > 1 is not supported")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits (docs/architecture.md, the path of one request through the engine).

    `admission_watermark`: share of the KV pool a new request must leave free while others run.
    `prefill_budget_with_decodes`: prompt tokens a step may carry while decodes run in it.
    `background_prefill_budget`: the same for background requests (priority above 0) while
    interactive work is about, which lasts `background_cap_linger_steps` past the last one seen.
    None: no cap beyond max_num_batched_tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    admission_watermark: float = 0.03
    prefill_budget_with_decodes: int | None = None
    background_prefill_budget: int | None = None
    background_cap_linger_steps: int = 64

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0 <= self.admission_watermark < 1:
            raise ValueError(
                f"admission_watermark must be in [0, 1), got {self.admission_watermark}"
            )
        if self.prefill_budget_with_decodes is not None and self.prefill_budget_with_decodes < 1:
            raise ValueError(
                "prefill_budget_with_decodes must be >= 1 (or None), "
                f"got {self.prefill_budget_with_decodes}"
            )


_MODES: dict[str, object] = {
    "dtype": Dtype,
    "quantization": Quantization | None,
    "kv_cache_dtype": KVCacheDtype,
    "load_format": LoadFormat,
    "attention_backend": AttentionBackend,
}


def mode_names(mode: object) -> tuple[object, ...]:
    """The values a Literal mode type (or a union of them, with None) allows."""
    names: list[object] = []
    for arg in get_args(mode):
        names.extend(get_args(arg) if get_args(arg) else [None] if arg is type(None) else [arg])
    return tuple(names)


def check_mode(name: str, value: object, mode: object) -> None:
    """Raises ValueError when `value` is none of the names `mode` (a Literal type) allows."""
    allowed = mode_names(mode)
    if value in allowed:
        return
    names = [str(choice) for choice in allowed if choice is not None]
    if None in allowed:
        raise ValueError(f"{name} must be {' or '.join(names)}, or None, got {value!r}")
    raise ValueError(f"{name} must be one of {', '.join(names)}, got {value!r}")
